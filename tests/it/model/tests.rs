//! Each configuration is checked exhaustively with the bugs off, and with each bug on, where it
//! must yield a counterexample to the property that bug breaks. The counts of states are exact:
//! the checker explores every reachable state, and the set of them does not depend on the order.

use stateright::{Checker, Model};

use super::protocol::*;

/// Every failed answer a sink can give.
const SINK_FAILURES: &[Outcome] = &[
    Outcome::Retryable,
    Outcome::Permanent,
    Outcome::Unavailable,
    Outcome::UnconfirmedUp,
    Outcome::UnconfirmedDown,
    Outcome::Defer,
];

/// The answers of a sink that is away: it says so, or it goes silent and then says it is down.
const OUTAGES: &[Outcome] = &[Outcome::Unavailable, Outcome::UnconfirmedDown];

/// Without the gate: one fault of any kind in a run (a sink failure, a crash, a stall).
fn one_fault_of_any_kind() -> Protocol {
    Protocol::new(false, Faults { outcomes: SINK_FAILURES, crash: true, stall: true, budget: 1 })
}

/// Without the gate: two failed answers of any kind in a run, workers that neither crash nor
/// stall.
fn two_sink_failures() -> Protocol {
    Protocol::new(false, Faults { outcomes: SINK_FAILURES, crash: false, stall: false, budget: 2 })
}

/// With the gate: two faults of any kind in a run.
fn fifo_two_faults_of_any_kind() -> Protocol {
    Protocol::new(true, Faults { outcomes: SINK_FAILURES, crash: true, stall: true, budget: 2 })
}

/// As many outages as a row has attempts: had an outage cost an attempt, a row whose claims all
/// met one would die on its last.
fn outages_as_long_as_the_attempts() -> Protocol {
    Protocol::new(false, Faults { outcomes: OUTAGES, crash: false, stall: false, budget: MAX_ATTEMPTS })
}

/// Checks every reachable state; returns how many there are.
fn check_all(name: &str, model: Protocol) -> usize {
    let checker = model.checker().spawn_bfs().join();
    println!(
        "{name}: {} states ({} generated), deepest run {} steps",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth()
    );
    checker.assert_properties();
    checker.unique_state_count()
}

/// Checks until `property` has a counterexample; returns its actions, which it prints.
fn counterexample(model: Protocol, property: &'static str) -> Vec<Action> {
    let checker = model.hunting(property).checker().spawn_bfs().join();
    let path = checker.discovery(property).unwrap_or_else(|| panic!("no counterexample to {property:?}"));
    println!("counterexample to {property:?}, after {} states:\n{path}", checker.unique_state_count());
    path.into_actions()
}

#[test]
fn one_fault_of_any_kind_breaks_no_property() {
    assert_eq!(check_all("one fault of any kind", one_fault_of_any_kind()), 9941);
}

#[test]
fn two_sink_failures_break_no_property() {
    assert_eq!(check_all("two sink failures", two_sink_failures()), 38038);
}

#[test]
fn under_fifo_two_faults_of_any_kind_break_no_property() {
    assert_eq!(check_all("fifo, two faults of any kind", fifo_two_faults_of_any_kind()), 69974);
}

#[test]
fn an_outage_alone_sends_no_row_dead() {
    assert_eq!(check_all("outages only", outages_as_long_as_the_attempts()), 17946);
}

#[test]
fn an_unfenced_finalize_is_caught() {
    let bugs = Bugs { unfenced_finalize: true, ..Bugs::default() };
    let path = counterexample(one_fault_of_any_kind().bugs(bugs), ONE_OUTCOME_PER_LEASE);
    assert!(matches!(path.last(), Some(Action::Finalize { .. })), "{path:?}");
    assert!(path.iter().any(|a| matches!(a, Action::Stall(_))), "a takeover needs a stalled worker: {path:?}");
    // Writing over a finished row takes a second fault: the stale outcome must differ.
    let path = counterexample(fifo_two_faults_of_any_kind().bugs(bugs), FINISHED_STAYS_FINISHED);
    assert!(matches!(path.last(), Some(Action::Finalize { .. })), "{path:?}");
}

#[test]
fn a_reclaim_without_a_version_bump_is_caught() {
    let bugs = Bugs { reclaim_without_bump: true, ..Bugs::default() };
    let path = counterexample(one_fault_of_any_kind().bugs(bugs), ONE_OUTCOME_PER_LEASE);
    assert!(matches!(path.last(), Some(Action::Finalize { .. })), "{path:?}");
}

#[test]
fn a_gate_that_lets_a_dead_head_through_is_caught() {
    let bugs = Bugs { gate_ignores_dead: true, ..Bugs::default() };
    let path = counterexample(fifo_two_faults_of_any_kind().bugs(bugs), FIFO_ORDER);
    assert!(matches!(path.last(), Some(Action::Publish { row: 1, .. })), "{path:?}");
}

#[test]
fn an_outage_taken_for_a_failure_of_the_message_is_caught() {
    let bugs = Bugs { outage_as_retryable: true, ..Bugs::default() };
    let path = counterexample(outages_as_long_as_the_attempts().bugs(bugs), OUTAGE_NEVER_KILLS);
    assert!(matches!(path.last(), Some(Action::Finalize { .. })), "{path:?}");
}

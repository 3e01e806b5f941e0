//! The checks at the end of the run, and the table and last line that report them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::ExitStatus;
use std::time::Duration;

use crate::Outcome;
use crate::fleet::{Unexpected, describe};
use crate::plan::{Fault, Kind, Window};
use crate::world::{Delivery, Produced, Row, StaleWrite};

/// Everything the run gathered.
pub struct Evidence<'a> {
    /// Whether the dispatchers ran with `--fifo`.
    pub fifo: bool,
    /// How many dispatcher processes ran.
    pub processes: usize,
    /// The schedule.
    pub faults: &'a [Fault],
    /// What each fault did, by index.
    pub outcomes: &'a [Outcome],
    /// The in-flight window the bounds derive from.
    pub window: Window,
    /// How long after a fault ends its duplicates may still arrive: a lease (until a takeover),
    /// a publish timeout, and room for a loaded machine.
    pub slack: Duration,
    /// What the producer did.
    pub produced: &'a Produced,
    /// Every row after the last graceful stop.
    pub rows: &'a [Row],
    /// Every delivery, in arrival order.
    pub deliveries: &'a [Delivery],
    /// Writes past a fence (the audit).
    pub stale: &'a [StaleWrite],
    /// Exits no fault caused.
    pub unexpected: Vec<Unexpected>,
    /// The last graceful stop of each process: owner, exit.
    pub final_stops: Vec<(String, Option<ExitStatus>)>,
    /// Database sessions not named after a process (the audit would miss their writes).
    pub unnamed: Vec<String>,
    /// Whether everything drained in time, and how long it took.
    pub drained: bool,
    /// How long the drain took.
    pub drain_took: Duration,
}

/// The checks' results.
pub struct Verdict {
    rows: usize,
    faults: usize,
    lost: usize,
    dups: u64,
    bound: u64,
    order: usize,
    table: Vec<String>,
    summary: Vec<String>,
    violations: Vec<String>,
}

/// At most this many examples of one violation are printed.
const EXAMPLES: usize = 5;

impl Verdict {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// Checks the evidence.
    pub fn judge(e: Evidence<'_>) -> Verdict {
        let mut violations = Vec::new();
        for o in e.outcomes {
            violations.extend(o.violations.iter().cloned());
        }
        let by_id: HashMap<i64, &Row> = e.rows.iter().map(|r| (r.id, r)).collect();
        let mut copies: HashMap<i64, Vec<&Delivery>> = HashMap::new();
        for d in e.deliveries {
            copies.entry(d.id).or_default().push(d);
        }
        let poison: HashMap<i64, usize> = e.produced.poison.iter().copied().collect();
        let uncertain: HashSet<i64> = e.produced.uncertain.iter().copied().collect();

        // Every committed row delivered at least once.
        let lost: Vec<i64> = e.produced.committed.iter().copied().filter(|id| !copies.contains_key(id)).collect();
        if !lost.is_empty() {
            let show: Vec<String> = lost
                .iter()
                .take(EXAMPLES)
                .map(|id| match by_id.get(id) {
                    Some(r) => format!("{id} ({}, {} attempts, {:?})", r.status, r.attempts, r.last_error),
                    None => format!("{id} (row missing)"),
                })
                .collect();
            violations.push(format!("{} committed rows never delivered: {}", lost.len(), show.join(", ")));
        }
        // None dead but the poisoned, and every poisoned one dead and never delivered.
        let dead: Vec<&Row> = e.rows.iter().filter(|r| r.status == "dead" && !poison.contains_key(&r.id)).collect();
        if !dead.is_empty() {
            let show: Vec<String> = dead
                .iter()
                .take(EXAMPLES)
                .map(|r| format!("{} ({} attempts: {})", r.id, r.attempts, r.last_error))
                .collect();
            violations.push(format!("{} rows dead that were not poisoned: {}", dead.len(), show.join("; ")));
        }
        for (&id, &fault) in &poison {
            match by_id.get(&id) {
                Some(r) if r.status == "dead" => {}
                Some(r) => violations.push(format!("poison row {id} (fault #{}) is {}, not dead", fault + 1, r.status)),
                None => violations.push(format!("poison row {id} (fault #{}) is gone", fault + 1)),
            }
            if copies.contains_key(&id) {
                violations.push(format!("poison row {id} (fault #{}) was delivered", fault + 1));
            }
        }
        // Nothing left processing after the last graceful stop.
        let processing: Vec<i64> = e.rows.iter().filter(|r| r.status == "processing").map(|r| r.id).collect();
        if !processing.is_empty() {
            violations.push(format!(
                "{} rows left processing after the last graceful stop: {:?}",
                processing.len(),
                &processing[..processing.len().min(EXAMPLES)]
            ));
        }
        let pending = e.rows.iter().filter(|r| r.status == "pending").count();
        if pending > 0 {
            violations.push(format!("{pending} rows still pending after the drain"));
        }
        if !e.drained {
            violations.push(format!("the backlog did not drain within {}s", e.drain_took.as_secs()));
        }
        // Nothing delivered that was never committed.
        let phantoms: Vec<i64> = copies
            .keys()
            .copied()
            .filter(|id| !uncertain.contains(id) && (!by_id.contains_key(id) || e.produced.rolled_back.contains(id)))
            .collect();
        if !phantoms.is_empty() {
            violations.push(format!("{} delivered ids were never committed: {:?}", phantoms.len(), phantoms));
        }
        // No write past a fence.
        if !e.stale.is_empty() {
            let show: Vec<String> = e
                .stale
                .iter()
                .take(EXAMPLES)
                .map(|s| {
                    format!(
                        "row {} at lease_version {} held by {} set {} by {}",
                        s.id, s.lease_version, s.lease_owner, s.new_status, s.writer
                    )
                })
                .collect();
            violations.push(format!(
                "{} stale writes past a fence (a process wrote a row another held): {}",
                e.stale.len(),
                show.join("; ")
            ));
        }
        if !e.unnamed.is_empty() {
            violations.push(format!(
                "database sessions not named after their process (the fencing audit cannot see them): {:?}",
                e.unnamed
            ));
        }
        for u in &e.unexpected {
            if !u.excused {
                violations.push(format!("{} ended by itself at {:.1}s: {}", u.owner, u.at, u.status));
            }
        }
        for (owner, status) in &e.final_stops {
            match status {
                Some(s) if s.success() => {}
                Some(s) => violations.push(format!("{owner} answered the last SIGTERM with {}", describe(*s))),
                None => violations.push(format!("{owner} did not stop within 30s of the last SIGTERM")),
            }
        }

        // Duplicates, each charged to a fault whose window it arrived in, while that fault's
        // bound lasts; the one whose window closes first goes first, leaving the later ones
        // room.
        let mut dup_times: Vec<(f64, i64)> = Vec::new();
        for (id, list) in &copies {
            dup_times.extend(list.iter().skip(1).map(|d| (d.at, *id)));
        }
        dup_times.sort_by(|a, b| a.0.total_cmp(&b.0));
        let bounds: Vec<u64> = e.faults.iter().map(|f| e.window.bound(f, e.processes)).collect();
        let windows: Vec<(f64, f64)> = e
            .faults
            .iter()
            .zip(e.outcomes)
            .map(|(f, o)| (f.at.as_secs_f64(), (f.at + o.lasted.max(f.duration) + e.slack).as_secs_f64()))
            .collect();
        let mut charged = vec![0_u64; e.faults.len()];
        let mut unexplained = Vec::new();
        for &(at, id) in &dup_times {
            let pick = (0..e.faults.len())
                .filter(|&i| windows[i].0 <= at && at <= windows[i].1 && charged[i] < bounds[i])
                .min_by(|&a, &b| windows[a].1.total_cmp(&windows[b].1));
            match pick {
                Some(i) => charged[i] += 1,
                None => unexplained.push((at, id)),
            }
        }
        let dups = dup_times.len() as u64;
        let bound: u64 = bounds.iter().sum();
        if !unexplained.is_empty() {
            let show: Vec<String> = unexplained
                .iter()
                .take(EXAMPLES)
                .map(|(at, id)| {
                    let attempts: Vec<String> = copies[id]
                        .iter()
                        .map(|d| format!("{:.1}s#{}", d.at, d.attempt.map_or("?".into(), |a| a.to_string())))
                        .collect();
                    format!("id {id} again at {at:.1}s (copies {})", attempts.join(" "))
                })
                .collect();
            violations.push(format!(
                "{} duplicates beyond the bounds of the faults around them: {}",
                unexplained.len(),
                show.join("; ")
            ));
        }

        // Under --fifo: the first delivery of each id of an aggregate arrives in id order.
        let mut order = 0;
        if e.fifo {
            let mut first_seen = HashSet::new();
            let mut highest: HashMap<&str, i64> = HashMap::new();
            let mut examples = Vec::new();
            for d in e.deliveries {
                if !first_seen.insert(d.id) {
                    continue;
                }
                let Some(row) = by_id.get(&d.id) else { continue };
                let top = highest.entry(row.aggregate.as_str()).or_insert(i64::MIN);
                if d.id < *top {
                    order += 1;
                    if examples.len() < EXAMPLES {
                        examples
                            .push(format!("{}: {} first arrived at {:.1}s, after {}", row.aggregate, d.id, d.at, top));
                    }
                } else {
                    *top = d.id;
                }
            }
            if order > 0 {
                violations.push(format!("{order} deliveries out of aggregate order: {}", examples.join("; ")));
            }
        }

        let mut table = vec![format!(
            "{:>3} {:>7}  {:<26} {:<4} {:>7} {:>6} {:>5}  {}",
            "#", "at", "fault", "proc", "lasted", "bound", "dups", "outcome"
        )];
        for (i, (f, o)) in e.faults.iter().zip(e.outcomes).enumerate() {
            let target = match f.kind {
                Kind::NodeLoss { node } => format!("n{node}"),
                kind if kind.is_poison() => "-".to_owned(),
                _ => format!("p{}", f.process + 1),
            };
            let mut note = o.note.clone();
            if f.kind.is_poison() {
                let ids: Vec<String> = poison.iter().filter(|(_, x)| **x == i).map(|(id, _)| id.to_string()).collect();
                let states: Vec<String> = ids
                    .iter()
                    .filter_map(|id| id.parse().ok().and_then(|id: i64| by_id.get(&id)))
                    .map(|r| format!("row {} {}", r.id, r.status))
                    .collect();
                note = if states.is_empty() { "not inserted".into() } else { states.join(", ") };
            }
            if !o.violations.is_empty() {
                note += " VIOLATION";
            }
            table.push(format!(
                "{:>3} {:>6.1}s  {:<26} {:<4} {:>6.1}s {:>6} {:>5}  {}",
                i + 1,
                f.at.as_secs_f64(),
                f.kind.to_string(),
                target,
                o.lasted.as_secs_f64(),
                bounds[i],
                charged[i],
                note
            ));
        }

        let sources: BTreeMap<&str, usize> = e.deliveries.iter().fold(BTreeMap::new(), |mut m, d| {
            if let Some(s) = &d.source {
                *m.entry(s.as_str()).or_default() += 1;
            }
            m
        });
        let attempts_max = e.deliveries.iter().filter_map(|d| d.attempt).max().unwrap_or(0);
        let mut summary = vec![
            format!(
                "committed {} rows in {} single-row and {} batch transactions, {} poison rows, {} rows rolled back{}",
                e.produced.committed.len(),
                e.produced.transactions.0,
                e.produced.transactions.1,
                e.produced.poison.len(),
                e.produced.rolled_back.len(),
                if uncertain.is_empty() { String::new() } else { format!(", {} uncertain", uncertain.len()) }
            ),
            format!(
                "{} deliveries of {} ids, highest x-attempt {attempts_max}; drained in {:.1}s; {} stale writes",
                e.deliveries.len(),
                copies.len(),
                e.drain_took.as_secs_f64(),
                e.stale.len()
            ),
        ];
        if sources.is_empty() {
            summary.push("no delivery carried x-outbox-source".into());
        } else {
            summary.push(format!("x-outbox-source: {sources:?}"));
        }
        let excused = e.unexpected.iter().filter(|u| u.excused).count();
        if excused > 0 {
            summary.push(format!("{excused} starts refused while the database link was down (exit 1, as documented)"));
        }
        if !e.fifo {
            summary.push("order not checked (run without --fifo)".into());
        }

        Verdict {
            rows: e.produced.committed.len() + e.produced.poison.len(),
            faults: e.faults.len(),
            lost: lost.len(),
            dups,
            bound,
            order,
            table,
            summary,
            violations,
        }
    }

    /// The table, the summary, the violations, and the last line.
    pub fn print(&self, seed: u64, replay: &str) {
        println!();
        for line in &self.table {
            println!("{line}");
        }
        println!();
        for line in &self.summary {
            println!("chaos: {line}");
        }
        for v in &self.violations {
            println!("chaos: VIOLATION: {v}");
        }
        if self.passed() {
            println!("chaos: passed (seed {seed})");
        } else {
            println!("chaos: FAILED with seed {seed}; replay: {replay}");
        }
        println!(
            "chaos: {} rows, {} faults, {} lost, {} duplicates (bound {}), {} order violations",
            self.rows, self.faults, self.lost, self.dups, self.bound, self.order
        );
    }
}

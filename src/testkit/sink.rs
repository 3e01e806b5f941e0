//! An in-memory sink that records what the dispatcher publishes and answers as told.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::model::OutboxMessage;
use crate::publisher::{PublishFuture, PublishResult, Publisher};

/// One call of the sink: the message as the dispatcher handed it over, and what the sink
/// answered.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SinkCall {
    /// The message (its `attempts` says which attempt this was).
    pub message: Arc<OutboxMessage>,
    /// The answer.
    pub answer: PublishResult,
}

/// A told answer: for which event type, how many more times (`None`: for ever).
#[derive(Debug)]
struct Rule {
    event_type: String,
    answer: PublishResult,
    remaining: Option<u32>,
}

#[derive(Debug, Default)]
struct State {
    calls: Vec<SinkCall>,
    rules: Vec<Rule>,
}

/// A [`Publisher`] for tests: records every message handed to it and answers `Ok(())` unless
/// told otherwise for an event type ([`answer`](MemorySink::answer),
/// [`answer_times`](MemorySink::answer_times)).
///
/// Clones share one record, so a test keeps one and gives another to the dispatcher:
///
/// ```no_run
/// # async fn example(db: actix_outbox::testkit::TestDatabase) {
/// use actix_outbox::PublishError;
/// use actix_outbox::testkit::{MemorySink, drain_until_idle};
///
/// let sink = MemorySink::new();
/// sink.answer_times("payment.charged", 2, Err(PublishError::Retryable("gateway timeout".into())));
/// sink.answer("legacy.event", Err(PublishError::Permanent("no route".into())));
/// drain_until_idle(db.pool(), sink.clone()).await.unwrap();
/// sink.assert_published("payment.charged", 1); // on its third attempt
/// # }
/// ```
///
/// Answers are the dispatcher's outcomes: [`PublishError::Retryable`](crate::PublishError::Retryable) backs off and tries again
/// (spending an attempt), [`PublishError::Permanent`](crate::PublishError::Permanent) sends the row dead at once,
/// [`PublishError::Unavailable`](crate::PublishError::Unavailable) puts it back with its attempt refunded and pauses the
/// dispatcher until a probe gets through, [`PublishError::Defer`](crate::PublishError::Defer) puts it back for its delay.
/// The sink itself never reports a [`SinkState`](crate::sink::SinkState) other than up.
#[derive(Debug, Clone, Default)]
pub struct MemorySink {
    state: Arc<Mutex<State>>,
}

impl MemorySink {
    /// A sink that takes everything.
    pub fn new() -> Self {
        Self::default()
    }

    /// From now on, answers every message of `event_type` with `answer` (the latest rule for a
    /// type wins; `Ok(())` lifts an earlier failure).
    pub fn answer(&self, event_type: &str, answer: PublishResult) -> &Self {
        self.push(event_type, answer, None)
    }

    /// Answers the next `times` messages of `event_type` with `answer`, then as before.
    pub fn answer_times(&self, event_type: &str, times: u32, answer: PublishResult) -> &Self {
        self.push(event_type, answer, Some(times))
    }

    fn push(&self, event_type: &str, answer: PublishResult, remaining: Option<u32>) -> &Self {
        self.lock().rules.push(Rule { event_type: event_type.to_owned(), answer, remaining });
        self
    }

    /// Every call so far, in order, whatever was answered.
    pub fn calls(&self) -> Vec<SinkCall> {
        self.lock().calls.clone()
    }

    /// The messages published (answered `Ok`), in the order they were published. A message
    /// the dispatcher published twice (at-least-once) is here twice.
    pub fn published(&self) -> Vec<Arc<OutboxMessage>> {
        self.lock().calls.iter().filter(|c| c.answer.is_ok()).map(|c| c.message.clone()).collect()
    }

    /// The messages of `event_type` published, in order.
    pub fn published_of(&self, event_type: &str) -> Vec<Arc<OutboxMessage>> {
        self.published().into_iter().filter(|m| m.event_type == event_type).collect()
    }

    /// The ids of the messages published, in order.
    pub fn published_ids(&self) -> Vec<i64> {
        self.published().iter().map(|m| m.id).collect()
    }

    /// Forgets every call (the answers told stay).
    pub fn clear(&self) {
        self.lock().calls.clear();
    }

    /// Panics unless exactly `count` messages of `event_type` were published, saying what
    /// was published instead.
    #[track_caller]
    pub fn assert_published(&self, event_type: &str, count: usize) {
        let published = self.published();
        let found = published.iter().filter(|m| m.event_type == event_type).count();
        if found != count {
            let mut by_type: BTreeMap<&str, usize> = BTreeMap::new();
            for m in &published {
                *by_type.entry(&m.event_type).or_default() += 1;
            }
            panic!(
                "expected {count} `{event_type}` message(s) published, found {found}; published by type: {by_type:?}"
            );
        }
    }

    /// Panics if anything was published.
    #[track_caller]
    pub fn assert_nothing_published(&self) {
        let ids = self.published_ids();
        assert!(ids.is_empty(), "expected nothing published, found outbox ids {ids:?}");
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock left a consistent record behind.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Publisher for MemorySink {
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        let mut state = self.lock();
        let rule = state.rules.iter_mut().rev().find(|r| r.event_type == message.event_type && r.remaining != Some(0));
        let answer = match rule {
            Some(rule) => {
                if let Some(n) = rule.remaining.as_mut() {
                    *n -= 1;
                }
                rule.answer.clone()
            }
            None => Ok(()),
        };
        state.calls.push(SinkCall { message, answer: answer.clone() });
        Box::pin(std::future::ready(answer))
    }
}

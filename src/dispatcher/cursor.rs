//! The dispatcher's cursor over new rows (`store::Cursor`), held by one claim at a time.
//!
//! A claim that holds the cursor takes the new rows after it and moves it on; claims of the
//! same dispatcher never scan the same new rows at once, so none passes rows that another of
//! its claims holds locked and then loses (the lost claim's rows would be behind the cursor).
//! A worker that finds the cursor held waits for it: it is woken when the holder hands it back.
//! A claim is a few milliseconds, so the workers take turns without waiting much, and their
//! publishes overlap as before.
//!
//! The holder gets a [`CursorLease`]: the cursor goes back when the lease is dropped, moved on
//! if the claim succeeded ([`CursorLease::advance`]) and as it was otherwise, so a claim that
//! fails, or whose actor dies mid-claim, leaves the cursor where it was and the next claim scans
//! those rows again. The first claim starts the cursor at the outbox's horizon.

use std::sync::{Arc, Mutex};

use actix::Recipient;

use super::wake::Wake;
use crate::store::{Cursor, Position, Snapshot, Taken};

/// The cursor, and who waits for it.
#[derive(Debug, Default)]
pub(crate) struct CursorSlot {
    state: Mutex<SlotState>,
}

#[derive(Debug, Default)]
struct SlotState {
    /// `None` before the first claim read the horizon.
    cursor: Option<Cursor>,
    held: bool,
    /// Workers that found the cursor held, by index, each woken once when it is handed back.
    waiting: Vec<(usize, Recipient<Wake>)>,
}

/// The cursor, held by one claim until dropped.
#[derive(Debug)]
pub(crate) struct CursorLease {
    slot: Arc<CursorSlot>,
    /// What goes back into the slot.
    cursor: Option<Cursor>,
    /// Whether to put `None` back (the cursor was forgotten).
    forgotten: bool,
}

impl CursorSlot {
    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the cursor, or, when a claim holds it, registers worker `n` (`waker` gives its
    /// address) to be woken when it is handed back.
    pub(crate) fn take(self: &Arc<Self>, n: usize, waker: impl FnOnce() -> Recipient<Wake>) -> Option<CursorLease> {
        let mut state = self.state();
        if state.held {
            if !state.waiting.iter().any(|(w, _)| *w == n) {
                state.waiting.push((n, waker()));
            }
            return None;
        }
        state.held = true;
        Some(CursorLease { slot: self.clone(), cursor: state.cursor.clone(), forgotten: false })
    }

    /// Moves the cursor to the outbox's horizon when that is ahead of it (in its snapshot and in
    /// where it starts): every row visible in the horizon is finished, so a cursor that lags (a
    /// dispatcher whose claims are rare) skips what the others have done instead of scanning
    /// it. Not while a claim holds it.
    pub(crate) fn catch_up(&self, horizon: &Snapshot) {
        let mut state = self.state();
        if state.held {
            return;
        }
        // Ahead in position too (a cursor at the horizon starts after its xmax): a horizon that a
        // pass moved to just before the first unfinished transaction of a backlog covers the
        // snapshot of a cursor deep in that backlog, and starting the cursor there would walk
        // again what it passed.
        if let Some(cursor) = &state.cursor
            && horizon.covers(cursor.seen())
            && horizon != cursor.seen()
            && (horizon.xmax(), 0) > cursor.from()
        {
            state.cursor = Some(Cursor::at(horizon.clone()));
        }
    }
}

impl CursorSlot {
    /// Where the claims have passed to: the cursor's [`Cursor::from`] as it stands between two
    /// claims (a claim in flight has not moved it yet); `None` before the first claim.
    pub(crate) fn passed(&self) -> Option<Position> {
        self.state().cursor.as_ref().map(Cursor::from)
    }

    /// Forgets the cursor, unless a claim holds it: the next claim starts it again at the
    /// outbox's horizon. After the database failed a claim: what answers next may be another
    /// server (a failover), whose transaction ids need not follow the cursor's.
    pub(crate) fn forget(&self) {
        let mut state = self.state();
        if !state.held {
            state.cursor = None;
        }
    }
}

impl CursorLease {
    /// The cursor; `None` before the first claim started it.
    pub(crate) fn cursor(&self) -> Option<&Cursor> {
        self.cursor.as_ref()
    }

    /// Starts the cursor at `horizon` (the first claim's).
    pub(crate) fn start_at(&mut self, horizon: Snapshot) {
        self.cursor = Some(Cursor::at(horizon));
        self.forgotten = false;
    }

    /// Moves the cursor on after a claim that succeeded: its statement ran on `snapshot` and did
    /// `taken` with the cursor's rows. Returns false, and forgets the cursor (the next claim
    /// starts it again at the outbox's horizon), when `snapshot` is not later than the cursor's:
    /// the database's transaction ids went back, as after a failover to a standby that had not
    /// received everything, or a restore, and the ids the cursor took for finished may be
    /// handed out again.
    pub(crate) fn advance(&mut self, snapshot: &Snapshot, taken: &Taken) -> bool {
        match &mut self.cursor {
            Some(cursor) if snapshot.covers(cursor.seen()) => {
                cursor.advance(snapshot, taken);
                true
            }
            Some(_) => {
                self.cursor = None;
                self.forgotten = true;
                false
            }
            None => true,
        }
    }
}

impl Drop for CursorLease {
    fn drop(&mut self) {
        let waiting = {
            let mut state = self.slot.state();
            state.held = false;
            if self.cursor.is_some() || self.forgotten {
                state.cursor = self.cursor.take();
            }
            std::mem::take(&mut state.waiting)
        };
        for (_, worker) in waiting {
            worker.do_send(Wake);
        }
    }
}

//! Where a dispatcher stands in the stream of new rows: which ones it has passed, told apart by
//! the transaction that inserted them.
//!
//! Every row records the top-level transaction that inserted it (`txid`, a 64-bit `xid8`
//! filled in by the column's default). Rows become visible in commit order, which is not the
//! order of their ids nor of their `txid`s: a transaction that began first may commit last. A
//! cursor over ids alone would pass such a row before it commits and never come back for it
//! (Watermill lost messages that way). A cursor over PostgreSQL snapshots does not:
//!
//! - [`Cursor::seen`] is a snapshot such that every row whose transaction is visible in it has
//!   been passed. The rows left are those of transactions that were in progress then (its
//!   `xip`, all below its `xmax`) and those of later ones (`txid >= xmax`).
//! - Rows of later transactions are taken in `(txid, id)` order from [`Cursor::after`], the last
//!   one passed, through the index `outbox_txid`: a claim of a deep backlog never walks what it
//!   passed before.
//! - A transaction still in progress when the cursor passed positions beyond its `txid` may
//!   commit rows behind [`Cursor::after`]. Its id was in the snapshot of the claim that moved
//!   the cursor (that snapshot's `xip`), so the cursor remembers it in [`Cursor::late`] with
//!   the last id of it passed, and probes it by `(txid, id)` until it has committed and every
//!   row of it has been passed.
//! - A claim that finds fewer new rows than it asked for has passed everything its own snapshot
//!   shows: the cursor starts again from that snapshot ([`Cursor::advance`]).
//!
//! Nothing here touches the database: the claim statement (`claim.rs`) binds
//! [`Cursor::late`] and [`Cursor::from`] and returns its snapshot and what it took, from which
//! [`Cursor::advance`] computes the next cursor. A cursor starts at the outbox's horizon (the
//! sweep's `outbox_horizon`: every row visible in it is finished or waits in `outbox_later`).

use std::collections::BTreeMap;
use std::fmt;

/// A PostgreSQL snapshot (`pg_snapshot`, text form `xmin:xmax:xip,xip,...`): transactions below
/// `xmin` are finished, those from `xmax` on had not finished, and `xip` lists those in
/// progress between the two.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    xmin: u64,
    xmax: u64,
    xip: Vec<u64>,
}

/// A `pg_snapshot` that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a PostgreSQL snapshot: {0:?}")]
pub struct BadSnapshot(String);

impl Snapshot {
    /// The snapshot before any transaction (`3:3:`, 3 being PostgreSQL's first normal
    /// transaction id): nothing is visible in it.
    pub fn origin() -> Self {
        Snapshot { xmin: 3, xmax: 3, xip: Vec::new() }
    }

    /// Parses the text form of a `pg_snapshot`.
    pub fn parse(text: &str) -> Result<Self, BadSnapshot> {
        let bad = || BadSnapshot(text.to_owned());
        let mut parts = text.trim().splitn(3, ':');
        let mut number = || parts.next().ok_or_else(bad)?.parse::<u64>().map_err(|_| bad());
        let (xmin, xmax) = (number()?, number()?);
        let xip = match parts.next() {
            Some("") | None => Vec::new(),
            Some(list) => list.split(',').map(|x| x.parse::<u64>().map_err(|_| bad())).collect::<Result<_, _>>()?,
        };
        if xmin > xmax || xip.iter().any(|&x| x < xmin || x >= xmax) {
            return Err(bad());
        }
        Ok(Snapshot { xmin, xmax, xip })
    }

    /// Whether transaction `txid` had committed (or aborted) when the snapshot was taken, as
    /// `pg_visible_in_snapshot` says.
    pub fn visible(&self, txid: u64) -> bool {
        txid < self.xmin || (txid < self.xmax && !self.xip.contains(&txid))
    }

    /// Whether every transaction visible in `other` is visible in this snapshot too: this one
    /// was taken at the same time as `other` or after it.
    pub fn covers(&self, other: &Snapshot) -> bool {
        other.xmax <= self.xmax && self.xip.iter().all(|t| *t >= other.xmax || other.xip.contains(t))
    }

    /// This snapshot without transaction `txid` and every later one: the transactions visible in
    /// it are those visible here that are below `txid`.
    pub fn before(&self, txid: u64) -> Snapshot {
        let xmax = self.xmax.min(txid);
        let xmin = self.xmin.min(xmax);
        Snapshot { xmin, xmax, xip: self.xip.iter().copied().filter(|&t| t < xmax).collect() }
    }

    /// The first transaction id that had not finished when the snapshot was taken.
    pub fn xmax(&self) -> u64 {
        self.xmax
    }

    /// The transactions in progress between `xmin` and `xmax`.
    pub fn in_progress(&self) -> &[u64] {
        &self.xip
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:", self.xmin, self.xmax)?;
        for (i, x) in self.xip.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

/// A row's place in the order the cursor takes new rows: `(txid, id)`.
pub type Position = (u64, i64);

/// A dispatcher's cursor over new rows (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// Every row whose transaction is visible in this snapshot has been passed.
    seen: Snapshot,
    /// Transactions that may still hold rows not yet passed although rows after them were: each
    /// with the last id of it passed (0: none).
    late: BTreeMap<u64, i64>,
    /// The last row passed among those of transactions from `seen`'s `xmax` on.
    after: Option<Position>,
}

/// What a claim did with the cursor's rows, for [`Cursor::advance`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Taken {
    /// Rows the claim could take from the cursor at most.
    pub wanted: usize,
    /// Rows it found there (locked for it), before the byte budget.
    pub found: usize,
    /// Of those, how many the byte budget left for a later claim.
    pub cut: usize,
    /// The rows it took from [`Cursor::late`]'s transactions.
    pub late: Vec<Position>,
    /// The rows it took from after [`Cursor::from`].
    pub next: Vec<Position>,
}

impl Cursor {
    /// A cursor that has passed exactly the rows visible in `seen`.
    pub fn at(seen: Snapshot) -> Self {
        let late = seen.xip.iter().map(|&t| (t, 0)).collect();
        Cursor { seen, late, after: None }
    }

    /// The snapshot every row visible in which has been passed.
    pub fn seen(&self) -> &Snapshot {
        &self.seen
    }

    /// The transactions to probe for rows behind the cursor, each with the last id of it
    /// passed.
    pub fn late(&self) -> impl Iterator<Item = (u64, i64)> + '_ {
        self.late.iter().map(|(&t, &id)| (t, id))
    }

    /// Where the scan of rows of later transactions starts: after this position.
    pub fn from(&self) -> Position {
        self.after.unwrap_or((self.seen.xmax, 0))
    }

    /// The cursor after a claim whose statement ran on `snapshot` and took `taken`. Rows found
    /// but left by the byte budget are not passed; rows another claim held locked are passed
    /// (that claim takes them, or, if it fails, rewinds its own cursor).
    pub fn advance(&mut self, snapshot: &Snapshot, taken: &Taken) {
        for &(t, id) in &taken.late {
            let last = self.late.entry(t).or_insert(0);
            *last = (*last).max(id);
        }
        if taken.found < taken.wanted && taken.cut == 0 {
            // Everything the statement's snapshot shows has been passed.
            *self = Cursor::at(snapshot.clone());
            return;
        }
        if let Some(&last) = taken.next.iter().max() {
            // Transactions in progress at this claim whose ids lie before the new position may
            // commit rows behind it.
            for &t in &snapshot.xip {
                if t >= self.seen.xmax && t < last.0 {
                    self.late.entry(t).or_insert(0);
                }
            }
            self.after = Some(self.after.map_or(last, |a| a.max(last)));
        }
        if taken.cut == 0 {
            // A transaction that had committed by this claim, and all of whose rows the claim
            // scanned, has nothing left behind the cursor. The late rows come first in the
            // claim's order, so when it took fewer than it wanted from them it scanned them all;
            // otherwise it scanned all of those before its last late row's transaction.
            let late_scanned_upto = if taken.late.len() < taken.wanted {
                u64::MAX
            } else {
                taken.late.iter().map(|&(t, _)| t).max().unwrap_or(0)
            };
            self.late.retain(|&t, _| !(snapshot.visible(t) && t < late_scanned_upto));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(text: &str) -> Snapshot {
        Snapshot::parse(text).unwrap()
    }

    #[test]
    fn snapshots_parse_print_and_tell_visibility() {
        let s = snap("100:110:102,105");
        assert_eq!(s.to_string(), "100:110:102,105");
        assert!(s.visible(99) && s.visible(101) && s.visible(109));
        assert!(!s.visible(102) && !s.visible(105) && !s.visible(110) && !s.visible(200));
        assert_eq!(snap("5:5:").to_string(), "5:5:");
        assert_eq!(Snapshot::origin().to_string(), "3:3:");
        for bad in ["", "1", "5:4:", "1:5:7", "1:5:x", "a:b:"] {
            assert!(Snapshot::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_later_snapshot_covers_an_earlier_one() {
        let early = snap("100:110:102,105");
        assert!(snap("104:120:105,112").covers(&early));
        assert!(early.covers(&early));
        // 103 was visible in the earlier one: a snapshot where it runs is not later.
        assert!(!snap("103:120:103").covers(&early));
        assert!(!snap("100:108:").covers(&early));
        assert!(!early.covers(&snap("104:120:105,112")));
    }

    #[test]
    fn a_snapshot_cut_before_a_transaction_shows_only_those_below_it() {
        let s = snap("100:110:102,105");
        let cut = s.before(105);
        assert_eq!(cut, snap("100:105:102"));
        assert!(cut.visible(104) && !cut.visible(102) && !cut.visible(105) && !cut.visible(107));
        assert!(s.covers(&cut) && !cut.covers(&s));
        assert_eq!(s.before(98), snap("98:98:"), "below xmin: nothing from 98 on");
        assert_eq!(s.before(200), s, "above xmax: the same snapshot");
    }

    #[test]
    fn a_cursor_starts_after_its_snapshot_and_probes_what_was_in_progress() {
        let c = Cursor::at(snap("100:110:102,105"));
        assert_eq!(c.from(), (110, 0));
        assert_eq!(c.late().collect::<Vec<_>>(), vec![(102, 0), (105, 0)]);
    }

    #[test]
    fn a_short_claim_starts_the_cursor_again_from_its_snapshot() {
        let mut c = Cursor::at(snap("100:110:"));
        let taken = Taken { wanted: 10, found: 3, next: vec![(110, 1), (111, 2), (111, 3)], ..Taken::default() };
        c.advance(&snap("112:120:112,115"), &taken);
        assert_eq!(c, Cursor::at(snap("112:120:112,115")));
    }

    #[test]
    fn a_full_claim_moves_past_what_it_took_and_remembers_what_was_in_progress_behind() {
        let mut c = Cursor::at(snap("100:110:"));
        // 113 was in progress while the claim took rows of 112 and 114: it may commit rows
        // behind the new position; 120 lies after it and is scanned anyway.
        let taken = Taken { wanted: 2, found: 2, next: vec![(112, 7), (114, 9)], ..Taken::default() };
        c.advance(&snap("113:121:113,120"), &taken);
        assert_eq!(c.from(), (114, 9));
        assert_eq!(c.late().collect::<Vec<_>>(), vec![(113, 0)]);
        assert_eq!(c.seen(), &snap("100:110:"));
        // 113 commits two rows; a claim takes one of them (its batch is full): 113 stays, its
        // position moves.
        let taken = Taken { wanted: 1, found: 1, late: vec![(113, 20)], ..Taken::default() };
        c.advance(&snap("121:125:"), &taken);
        assert_eq!(c.late().collect::<Vec<_>>(), vec![(113, 20)]);
        // The next takes the other and a row after: 113 had committed and was scanned whole.
        let taken = Taken { wanted: 2, found: 2, late: vec![(113, 21)], next: vec![(115, 30)], ..Taken::default() };
        c.advance(&snap("121:126:"), &taken);
        assert_eq!(c.late().count(), 0);
        assert_eq!(c.from(), (115, 30));
    }

    #[test]
    fn rows_left_by_the_byte_budget_are_not_passed() {
        let mut c = Cursor::at(snap("100:110:105"));
        let taken = Taken { wanted: 10, found: 4, cut: 2, late: vec![(105, 3)], next: vec![(111, 4)] };
        c.advance(&snap("112:120:"), &taken);
        // Not a short claim (the budget cut it), and no transaction is let go.
        assert_eq!(c.seen(), &snap("100:110:105"));
        assert_eq!(c.late().collect::<Vec<_>>(), vec![(105, 3)]);
        assert_eq!(c.from(), (111, 4));
    }
}

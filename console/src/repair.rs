//! The two ways out of `dead`, all or nothing: what `actix-outbox dead retry|skip` and the
//! console's repair forms both run.

use std::collections::BTreeSet;

use actix_outbox::StoreError;
use diesel_async::{AsyncConnection, AsyncPgConnection};

/// What a repair does to each dead row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair<'a> {
    /// Back to `pending`, attempts reset, claimable now ([`actix_outbox::admin::dead_retry`]).
    Retry,
    /// `done` without publishing, `skipped by operator: <reason>` recorded in `last_error`
    /// ([`actix_outbox::admin::dead_skip`]).
    Skip {
        /// Why; the caller makes sure it is not blank.
        reason: &'a str,
    },
}

/// Why a repair changed nothing.
#[derive(Debug)]
#[non_exhaustive]
pub enum RepairError {
    /// These ids are not dead rows (any more, or never were); the transaction was rolled back,
    /// so no row changed.
    NotDead(Vec<i64>),
    /// The database failed; no row changed.
    Store(StoreError),
}

impl std::fmt::Display for RepairError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RepairError::NotDead(ids) => write!(f, "not a dead row: {} (no row changed)", id_list(ids)),
            RepairError::Store(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for RepairError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RepairError::NotDead(_) => None,
            RepairError::Store(e) => Some(e),
        }
    }
}

impl From<diesel::result::Error> for RepairError {
    fn from(e: diesel::result::Error) -> Self {
        RepairError::Store(StoreError::Query(e))
    }
}

/// A failure of the store (no connection, no answer within the pool's query timeout).
impl From<StoreError> for RepairError {
    fn from(e: StoreError) -> Self {
        RepairError::Store(e)
    }
}

/// Ids given once each, in ascending order.
pub fn distinct(ids: &[i64]) -> Vec<i64> {
    ids.iter().copied().collect::<BTreeSet<_>>().into_iter().collect()
}

/// `1, 2, 3`.
pub fn id_list(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
}

/// Applies `repair` to `ids` in one transaction, and rolls it back unless every one of them was
/// a dead row (the store's repairs touch dead rows only and return the ids they changed).
/// Returns the ids changed, ascending: all of `ids`, each once.
pub async fn all_or_nothing(
    conn: &mut AsyncPgConnection,
    ids: &[i64],
    repair: Repair<'_>,
) -> Result<Vec<i64>, RepairError> {
    let ids = distinct(ids);
    conn.transaction(async |tx| {
        let changed = match repair {
            Repair::Retry => actix_outbox::admin::dead_retry(tx, &ids).await,
            Repair::Skip { reason } => actix_outbox::admin::dead_skip(tx, &ids, reason).await,
        };
        let mut changed = changed.map_err(RepairError::Store)?;
        changed.sort_unstable();
        let not_dead: Vec<i64> = ids.iter().copied().filter(|id| changed.binary_search(id).is_err()).collect();
        if not_dead.is_empty() { Ok(changed) } else { Err(RepairError::NotDead(not_dead)) }
    })
    .await
}

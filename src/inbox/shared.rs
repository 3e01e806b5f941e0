//! What every consumer actor of one inbox supervisor shares: the configuration, the pool, the
//! handler, the counters and whether the database was last found out.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::config::InboxConfig;
use super::handler::InboxHandler;
use super::metrics::Counters;
use crate::store::PgPool;

/// What every consumer actor of one supervisor shares.
pub(crate) struct Shared {
    pub(crate) config: InboxConfig,
    pub(crate) pool: PgPool,
    pub(crate) handler: Arc<dyn InboxHandler>,
    pub(crate) counters: Counters,
    /// The last attempt (on any lane) found the database unreachable; cleared by the next
    /// success. During a shutdown, deliveries are then given back without trying.
    pub(crate) database_out: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("config", &self.config).field("pool", &self.pool).finish_non_exhaustive()
    }
}

//! What every actor of one dispatcher shares: set up once by the supervisor, read by all.

use std::sync::Arc;

use crate::config::DispatcherConfig;
use crate::metrics::Metrics;
use crate::publisher::Publisher;
use crate::store::PgPool;

/// The configuration, the pool, the sink and the counters of one dispatcher.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: DispatcherConfig,
    pub(crate) pool: PgPool,
    pub(crate) publisher: Arc<dyn Publisher>,
    pub(crate) metrics: Metrics,
}

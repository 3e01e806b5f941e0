//! The run's connections to RabbitMQ: the first one, waited for while the broker is down
//! ([`connect_broker`]), and one more for each further outbox ([`sink_of`]).

use std::time::Duration;

use rand::RngExt;
use tracing::warn;

use crate::CliError;
use actix_outbox::sink::{RabbitConfig, RabbitError, RabbitSink};

/// First pause before connecting to an unreachable broker again; it doubles up to
/// [`BROKER_RETRY_MAX`].
const BROKER_RETRY_MIN: Duration = Duration::from_millis(500);
/// Longest pause between two attempts to reach the broker at start.
const BROKER_RETRY_MAX: Duration = Duration::from_secs(30);

/// The broker connection of one more outbox (the first is made by [`connect_broker`]): each
/// outbox has its own, so that one outbox's drain never fills the confirm pipeline another's
/// messages wait in. Named after the outbox in the broker's connection list.
pub(super) async fn sink_of(rabbit: &RabbitConfig, name: Option<&str>) -> Result<RabbitSink, CliError> {
    RabbitSink::connect(named(rabbit, name)).await.map_err(|e| match e {
        e @ RabbitError::Config(_) => CliError::BadInput(e.to_string()),
        e => CliError::Failed(e.to_string()),
    })
}

/// `rabbit` with its connection named after the outbox `name`, unless named already.
pub(super) fn named(rabbit: &RabbitConfig, name: Option<&str>) -> RabbitConfig {
    match (name, &rabbit.connection_name) {
        (Some(name), None) => rabbit.clone().connection_name(format!("actix-outbox {name}")),
        _ => rabbit.clone(),
    }
}

/// Connects the RabbitMQ sink, retrying with capped, jittered exponential backoff while the
/// broker is unreachable. A broker that answers but refuses (credentials, vhost, an exchange of
/// another type) is a failure: retrying would not help.
pub(super) async fn connect_broker(config: RabbitConfig) -> Result<RabbitSink, CliError> {
    let mut ceiling = BROKER_RETRY_MIN;
    loop {
        match RabbitSink::connect(config.clone()).await {
            // The sink logs the connection itself.
            Ok(sink) => return Ok(sink),
            Err(e) if e.is_transient() => {
                // Half fixed, half jitter: never hammers the broker, and many dispatchers
                // started together do not reconnect in step.
                let delay = ceiling / 2 + ceiling.mul_f64(rand::rng().random_range(0.0..0.5));
                warn!(error = %e, retry_in = %humantime::format_duration(round_ms(delay)),
                    "RabbitMQ unreachable; retrying");
                tokio::time::sleep(delay).await;
                ceiling = (ceiling * 2).min(BROKER_RETRY_MAX);
            }
            Err(e @ RabbitError::Config(_)) => return Err(CliError::BadInput(e.to_string())),
            Err(e) => return Err(CliError::Failed(e.to_string())),
        }
    }
}

/// `d` to the millisecond, for a log line.
pub(super) fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}

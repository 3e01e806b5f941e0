//! How a delivery leaves our hands: acknowledged, given back, or forwarded (a retry copy or a
//! dead letter, published with confirms) and then acknowledged.

use std::time::Duration;

use lapin::Acker;
use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::AMQPValue;
use tokio::sync::watch;
use tracing::{debug, error, warn};

use super::delivery::{Envelope, Settled};
use super::link::{PublishFailure, publish_confirmed};
use super::message::{
    ATTEMPT_HEADER, CONSUMER_HEADER, ERROR_HEADER, EXCHANGE_HEADER, LAST_ERROR_HEADER, QUEUE_HEADER, ROUTING_KEY_HEADER,
};
use super::shared::Shared;
use crate::backoff::half_jitter;

/// Longest reason carried in a header.
const MAX_REASON_BYTES: usize = 4096;
/// Bound on an acknowledgement (lapin's settle of a channel that died can be slow to come).
const ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// Where a forwarded copy goes.
#[derive(Clone, Copy)]
pub(super) enum Forward<'a> {
    /// Back to the queue (default exchange) for the next attempt; the reason of this failure.
    Retry(&'a str),
    /// To the dead-letter exchange, with the reason.
    DeadLetter(&'a str),
}

/// Publishes a copy (confirmed), then acknowledges the original. A copy the broker refuses is
/// held and tried again after a backoff (given back at shutdown); a broken channel abandons the
/// delivery to the broker's redelivery. Either way nothing is lost.
pub(super) async fn forward(
    shared: &Shared,
    envelope: &Envelope,
    body: &[u8],
    to: Forward<'_>,
    mut drain: watch::Receiver<bool>,
) -> Settled {
    let config = &shared.config;
    let dead_letter_exchange = config.dead_letter_exchange_name();
    let (exchange, properties, success) = match to {
        Forward::Retry(reason) => {
            let headers = [
                (ATTEMPT_HEADER, AMQPValue::LongInt(i32::try_from(envelope.attempt + 1).unwrap_or(i32::MAX))),
                (LAST_ERROR_HEADER, long_string(reason)),
            ];
            ("", with_headers(envelope, &headers), Settled::Retried)
        }
        Forward::DeadLetter(reason) => {
            let headers = [
                (ERROR_HEADER, long_string(reason)),
                (ATTEMPT_HEADER, AMQPValue::LongInt(i32::try_from(envelope.attempt).unwrap_or(i32::MAX))),
                (CONSUMER_HEADER, long_string(&config.consumer)),
                (QUEUE_HEADER, long_string(&config.queue)),
            ];
            (dead_letter_exchange.as_str(), with_headers(envelope, &headers), Settled::DeadLettered)
        }
    };
    let mut refusals = 0_i32;
    loop {
        if !envelope.acker.usable() {
            return Settled::Abandoned;
        }
        let published = {
            let _one_at_a_time = envelope.forwards.lock().await;
            publish_confirmed(&envelope.channel, exchange, &config.queue, properties.clone(), body).await
        };
        match published {
            Ok(()) => {
                ack(&envelope.acker).await;
                return success;
            }
            Err(PublishFailure::Link(e)) => {
                debug!(error = %e, "forwarding failed with the channel; the broker delivers the original again");
                return Settled::Abandoned;
            }
            Err(PublishFailure::Refused(e)) => {
                if *drain.borrow() {
                    warn!(error = %e, "forwarding refused during shutdown; giving the delivery back");
                    requeue(&envelope.acker).await;
                    return Settled::Requeued;
                }
                let delay = half_jitter(refusals, config.outage_backoff_min, config.outage_backoff_max);
                refusals = refusals.saturating_add(1);
                error!(error = %e, exchange = %exchange, retry_in = ?delay,
                    "the broker refused a forwarded copy; holding the delivery and trying again");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = drain.changed() => {}
                }
            }
        }
    }
}

/// The original's properties with `headers` added, and its first exchange and routing key kept.
pub(super) fn with_headers(envelope: &Envelope, headers: &[(&str, AMQPValue)]) -> BasicProperties {
    let mut table = envelope.properties.headers().clone().unwrap_or_default();
    table.insert(EXCHANGE_HEADER.into(), long_string(&envelope.exchange));
    table.insert(ROUTING_KEY_HEADER.into(), long_string(&envelope.routing_key));
    for (name, value) in headers {
        table.insert((*name).into(), value.clone());
    }
    envelope.properties.clone().with_headers(table)
}

pub(super) fn long_string(text: &str) -> AMQPValue {
    let mut end = text.len().min(MAX_REASON_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    AMQPValue::LongString(text[..end].into())
}

pub(super) async fn ack(acker: &Acker) {
    match tokio::time::timeout(ACK_TIMEOUT, acker.ack(BasicAckOptions::default())).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => debug!("acknowledgement skipped: the channel is gone; the broker delivers the message again"),
        Ok(Err(e)) => debug!(error = %e, "acknowledgement failed; the broker delivers the message again"),
        Err(_) => warn!("acknowledgement not settled in time; the broker delivers the message again if it was lost"),
    }
}

pub(super) async fn requeue(acker: &Acker) {
    let nack = acker.nack(BasicNackOptions { multiple: false, requeue: true });
    match tokio::time::timeout(ACK_TIMEOUT, nack).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => debug!(error = %e, "nack failed; the broker delivers the message again anyway"),
        Err(_) => warn!("nack not settled in time; the broker delivers the message again when the channel closes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_reasons_are_cut_on_a_char_boundary() {
        let reason = "é".repeat(MAX_REASON_BYTES);
        match long_string(&reason) {
            AMQPValue::LongString(s) => assert!(s.as_bytes().len() <= MAX_REASON_BYTES),
            other => panic!("{other:?}"),
        }
    }
}

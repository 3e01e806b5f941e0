//! The raw publisher: the broker ceiling. Plain lapin, no database, the sink's messages.

use std::process::ExitCode;
use std::sync::Arc;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{Confirmation, Connection, ConnectionProperties};

use super::{commands, emit, wait_for};
use crate::message::{body, properties, rabbit_config};
use crate::{BoxError, BrokerChild, EVENT_TYPE, Opts};

/// Publishes ids `first_id ..` with the dispatcher's in-flight depth, one connection and one
/// confirm channel, like the sink; reports when the last confirm is in.
pub(crate) async fn broker(role: BrokerChild, opts: Opts) -> Result<ExitCode, BoxError> {
    let mut commands = commands();
    let conn = Connection::connect(opts.first_amqp_url(), ConnectionProperties::default()).await?;
    let mut channels = Vec::new();
    for _ in 0..opts.raw_channels.max(1) {
        let channel = conn.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        channels.push(channel);
    }
    let pad = opts.pad();
    let depth = opts.depth_per_process();
    let exchange: ShortString = role.exchange.as_str().into();
    let config = rabbit_config(&opts, &role.exchange);
    let source: Arc<str> = role.source.as_str().into();
    emit("ready");
    if !wait_for(&mut commands, "go", opts.phase_timeout).await {
        return Ok(ExitCode::FAILURE);
    }
    let mut in_flight = FuturesUnordered::new();
    let (mut acked, mut failed) = (0_usize, 0_usize);
    let mut settle = |outcome: Result<Confirmation, lapin::Error>| match outcome {
        Ok(Confirmation::Ack(None)) => acked += 1,
        _ => failed += 1,
    };
    let publish_all = async {
        for n in 0..role.count {
            if in_flight.len() >= depth
                && let Some(outcome) = in_flight.next().await
            {
                settle(outcome);
            }
            let id = role.first_id + n as i64;
            let channel = channels[n % channels.len()].clone();
            let (exchange, payload) = (exchange.clone(), body(id, &pad));
            let properties = properties(&config, &source, id, &(id % 1000).to_string());
            in_flight.push(async move {
                let options = BasicPublishOptions { mandatory: true, immediate: false };
                let confirm = channel.basic_publish(exchange, EVENT_TYPE.into(), options, &payload, properties).await?;
                confirm.await
            });
        }
        while let Some(outcome) = in_flight.next().await {
            settle(outcome);
        }
    };
    tokio::time::timeout(opts.phase_timeout, publish_all).await.map_err(|_| "raw publishing timed out")?;
    emit(&format!("final {{\"acked\":{acked},\"failed\":{failed}}}"));
    let _ = conn.close(200, "bench done".into()).await;
    Ok(ExitCode::SUCCESS)
}

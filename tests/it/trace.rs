//! Trace context through the outbox (feature `opentelemetry`): a producer's span context is
//! stored in the event's headers, arrives at a real consumer, and parents the dispatcher's
//! `publish` span. An SDK tracer provider exports to memory; the W3C propagator is global.

use std::sync::OnceLock;
use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::dispatcher::Shutdown;
use actix_outbox::schema::outbox;
use actix_outbox::sink::{RabbitConfig, RabbitSink};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxSupervisor};
use diesel::prelude::*;
use diesel_async::RunQueryDsl;
use lapin::types::AMQPValue;
use opentelemetry::trace::{TraceContextExt, TracerProvider};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

use actix_outbox_test_support::{PATIENCE, TestBroker, TestDb, amqp_url, eventually, saw};

/// The process's tracing: a global subscriber with an OpenTelemetry layer (the dispatcher's
/// spans live on its own arbiters' threads), exporting to memory.
fn telemetry() -> &'static (SdkTracerProvider, InMemorySpanExporter) {
    static TELEMETRY: OnceLock<(SdkTracerProvider, InMemorySpanExporter)> = OnceLock::new();
    TELEMETRY.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("actix-outbox-it")));
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber");
        (provider, exporter)
    })
}

/// An event built inside a span stores that span's `traceparent`; the message at a real
/// consumer carries the same one; the dispatcher's `publish` span is the producer span's child.
#[actix_rt::test]
async fn trace_context_flows_from_producer_to_consumer_and_parents_publish() {
    let (provider, exporter) = telemetry();
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("trace").await;

    let outside = NewEvent::new("order", "o-0", "order.created", serde_json::json!({})).with_trace_context();
    assert_eq!(outside.headers, None, "no span, no context");

    let producer = tracing::info_span!("place_order");
    let (trace_id, span_id) = {
        let cx = producer.context();
        let span_context = cx.span().span_context().clone();
        (span_context.trace_id(), span_context.span_id())
    };
    let event = producer.in_scope(|| {
        NewEvent::new("order", "o-1", "order.created", serde_json::json!({"n": 1}))
            .header("tenant", "acme")
            .with_trace_context()
    });
    let id = actix_outbox::enqueue(&mut db.conn().await, &event).await.unwrap();
    drop(producer);

    let stored: Option<serde_json::Value> =
        outbox::table.find(id).select(outbox::headers).first(&mut db.conn().await).await.unwrap();
    let traceparent = format!("00-{trace_id}-{span_id}-01");
    assert_eq!(stored, Some(serde_json::json!({"tenant": "acme", "traceparent": traceparent})));

    let sink = RabbitSink::connect(RabbitConfig::new(amqp_url()).exchange(&broker.exchange)).await.unwrap();
    let config = DispatcherConfig::default().poll_interval(Duration::from_millis(50));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();
    let delivered = broker.take(&queue, 1).await.pop().unwrap();
    eventually(PATIENCE, "row done", || async { saw(db.row(id).await, |row| row.status == Status::Done) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    let headers = delivered.properties.headers().as_ref().expect("headers");
    assert_eq!(headers.inner().get("traceparent"), Some(&AMQPValue::LongString(traceparent.as_str().into())));

    provider.force_flush().unwrap();
    let publish: Vec<_> = exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.name == "publish" && s.span_context.trace_id() == trace_id)
        .collect();
    assert_eq!(publish.len(), 1, "one publish span in the producer's trace");
    assert_eq!(publish[0].parent_span_id, span_id, "parented by the producer's span");
}

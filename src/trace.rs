//! W3C trace context through the outbox (feature `opentelemetry`).
//!
//! The producer side stores the current span's context in the event's headers
//! ([`NewEvent::with_trace_context`](crate::NewEvent::with_trace_context)); the dispatcher
//! parents its `publish` span with the context found in a claimed message's headers. Both go
//! through the application's global propagator
//! ([`opentelemetry::global::set_text_map_propagator`], e.g. the SDK's
//! `TraceContextPropagator`, which reads and writes `traceparent` and `tracestate`), and see
//! spans only through a `tracing_opentelemetry` layer installed in the application's
//! subscriber. Without either, nothing is stored and no span is parented.

use std::collections::BTreeMap;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The current span's context as the global propagator writes it (`traceparent`, and
/// `tracestate` when there is one); empty outside a span with an OpenTelemetry context.
pub(crate) fn current_context_headers() -> Vec<(String, String)> {
    struct Collect<'a>(&'a mut Vec<(String, String)>);
    impl Injector for Collect<'_> {
        fn set(&mut self, key: &str, value: String) {
            // The W3C propagator writes an empty `tracestate` when there is none: leave it out.
            if !value.is_empty() {
                self.0.push((key.to_owned(), value));
            }
        }
    }
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return Vec::new();
    }
    let mut out = Vec::new();
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.inject_context(&cx, &mut Collect(&mut out)));
    out
}

/// Parents `span` (not yet entered) with the context the global propagator extracts from
/// `headers`, when it finds a valid one.
pub(crate) fn set_parent_from(span: &tracing::Span, headers: &BTreeMap<String, String>) {
    struct Headers<'a>(&'a BTreeMap<String, String>);
    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).map(String::as_str)
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }
    if headers.is_empty() {
        return;
    }
    let cx = opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&Headers(headers)));
    if cx.span().span_context().is_valid() {
        // Fails only when no OpenTelemetry layer is installed: then there is nothing to parent.
        let _ = span.set_parent(cx);
    }
}

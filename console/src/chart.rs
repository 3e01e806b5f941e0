//! The overview's chart of the last hour: an in-process ring buffer of one sample a minute.
//!
//! Each sample holds the backlog (pending + processing) and the dead rows, read with the
//! overview's bounded statement, and, when the console has the dispatcher's address, how many
//! publishes the dispatcher's counters ([`MetricsSnapshot`]) say were acknowledged and failed
//! since the previous sample. No figure is read from the `done` history, so the chart costs
//! the same however long the table's tail. It starts empty when the process starts, and
//! counts only this process's dispatcher.
//!
//! [`MetricsSnapshot`]: actix_outbox::MetricsSnapshot

use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::Duration;

use actix_outbox::MetricsSnapshot;
use actix_outbox::dispatcher::GetMetrics;
use chrono::{DateTime, Utc};
use maud::{Markup, html};

use crate::{Config, Shared, query};

/// One sample a minute.
const EVERY: Duration = Duration::from_secs(60);
/// An hour of samples.
const KEPT: usize = 60;
/// How long the sampler waits for the dispatcher's counters.
const METRICS_TIMEOUT: Duration = Duration::from_secs(2);

/// One minute of the chart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Point {
    pub(crate) at: DateTime<Utc>,
    /// Publishes acknowledged since the previous sample; `None` without a dispatcher (or for
    /// the first sample, which has no previous one).
    pub(crate) published: Option<u64>,
    /// Publishes that failed (retried later, or dead) since the previous sample.
    pub(crate) failed: Option<u64>,
    /// Pending + processing rows at `at`.
    pub(crate) backlog: i64,
    /// Dead rows at `at`.
    pub(crate) dead: i64,
}

/// The ring buffer.
#[derive(Debug, Default)]
pub(crate) struct Samples {
    points: VecDeque<Point>,
    /// The dispatcher's counters at the previous sample.
    last: Option<(u64, u64)>,
}

impl Samples {
    /// Adds a sample; `counters` are the dispatcher's cumulative (published, failed).
    pub(crate) fn push(&mut self, at: DateTime<Utc>, backlog: i64, dead: i64, counters: Option<(u64, u64)>) {
        let (published, failed) = match (self.last, counters) {
            (Some((p0, f0)), Some((p1, f1))) => (Some(p1.saturating_sub(p0)), Some(f1.saturating_sub(f0))),
            _ => (None, None),
        };
        self.last = counters;
        if self.points.len() == KEPT {
            self.points.pop_front();
        }
        self.points.push_back(Point { at, published, failed, backlog, dead });
    }

    pub(crate) fn points(&self) -> Vec<Point> {
        self.points.iter().copied().collect()
    }
}

/// (published, failed) of the dispatcher's counters: acknowledged publishes, and rows that went
/// back to pending after a retryable failure or went dead.
fn counters(m: &MetricsSnapshot) -> (u64, u64) {
    (m.published, m.retried + m.dead)
}

/// Samples every minute while a clone of the console lives.
pub(crate) async fn sample(config: Config, shared: Weak<Shared>) {
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(shared) = shared.upgrade() else { return };
        sample_once(&config, &shared).await;
    }
}

async fn sample_once(config: &Config, shared: &Arc<Shared>) {
    let overview = config.pool.run(async |conn| query::overview(conn).await);
    let overview = match overview.await {
        Ok(overview) => overview,
        Err(e) => {
            // A gap in the chart says the database did not answer; the overview says why.
            tracing::debug!(error = %e, "console chart: the table sample failed");
            return;
        }
    };
    let counters = match &config.supervisor {
        Some(supervisor) => match tokio::time::timeout(METRICS_TIMEOUT, supervisor.send(GetMetrics)).await {
            Ok(Ok(metrics)) => Some(counters(&metrics)),
            _ => None,
        },
        None => None,
    };
    shared.chart.lock().unwrap_or_else(|e| e.into_inner()).push(
        Utc::now(),
        overview.backlog(),
        overview.dead,
        counters,
    );
}

/// Width and height of the chart's drawing, in SVG units.
const W: f64 = 720.0;
const PANEL: f64 = 110.0;
const GAP: f64 = 30.0;
const LEFT: f64 = 56.0;

/// The x of an instant, the window being the hour up to `now`.
fn x_of(at: DateTime<Utc>, now: DateTime<Utc>) -> f64 {
    let age = (now - at).num_milliseconds() as f64 / 1000.0;
    let frac = 1.0 - (age / 3600.0).clamp(0.0, 1.0);
    LEFT + frac * (W - LEFT - 8.0)
}

/// A polyline of `values` (x, value) in a panel whose top is `top` and whose scale tops at `max`.
fn line(values: &[(f64, f64)], top: f64, max: f64) -> String {
    values
        .iter()
        .map(|(x, v)| {
            let y = top + PANEL - (v / max) * PANEL;
            format!("{x:.1},{y:.1}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The largest value, at least 1 (an empty or flat-zero panel still has a scale).
fn scale(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(1.0, f64::max).ceil()
}

/// The chart as inline SVG: published and failed per minute (top panel), backlog and dead rows
/// (bottom panel), over the hour up to `now`. Pure, so that a test can draw it.
pub(crate) fn svg(points: &[Point], now: DateTime<Utc>) -> Markup {
    let rates: Vec<&Point> = points.iter().filter(|p| p.published.is_some()).collect();
    let published: Vec<(f64, f64)> = rates.iter().map(|p| (x_of(p.at, now), p.published.unwrap_or(0) as f64)).collect();
    let failed: Vec<(f64, f64)> = rates.iter().map(|p| (x_of(p.at, now), p.failed.unwrap_or(0) as f64)).collect();
    let backlog: Vec<(f64, f64)> = points.iter().map(|p| (x_of(p.at, now), p.backlog as f64)).collect();
    let dead: Vec<(f64, f64)> = points.iter().map(|p| (x_of(p.at, now), p.dead as f64)).collect();
    let rate_max = scale(published.iter().chain(&failed).map(|(_, v)| *v));
    let level_max = scale(backlog.iter().chain(&dead).map(|(_, v)| *v));
    let top1 = 16.0;
    let top2 = top1 + PANEL + GAP;
    let height = top2 + PANEL + 22.0;
    let view_box = format!("0 0 {W} {height}");
    html! {
        svg class="chart" viewBox=(view_box) role="img" aria-label="published, failed, backlog and dead rows over the last hour" xmlns="http://www.w3.org/2000/svg" {
            @for (top, max, label) in [(top1, rate_max, "per minute"), (top2, level_max, "rows")] {
                rect class="panel" x=(LEFT) y=(top) width=(W - LEFT - 8.0) height=(PANEL) {}
                text class="axis" x=(LEFT - 6.0) y=(top + 10.0) text-anchor="end" { (max) }
                text class="axis" x=(LEFT - 6.0) y=(top + PANEL) text-anchor="end" { "0" }
                text class="axis" x=(LEFT) y=(top - 4.0) { (label) }
            }
            text class="axis" x=(LEFT) y=(height - 4.0) { "−60 min" }
            text class="axis" x=(W - 8.0) y=(height - 4.0) text-anchor="end" { "now" }
            @if rates.is_empty() {
                text class="note" x=(LEFT + 10.0) y=(top1 + PANEL / 2.0) {
                    @if points.is_empty() { "collecting: the first sample is taken when the console starts, then one a minute" }
                    @else { "published and failed per minute need the dispatcher (Console::supervisor) and two samples" }
                }
            } @else {
                polyline class="published" points=(line(&published, top1, rate_max)) {}
                polyline class="failed" points=(line(&failed, top1, rate_max)) {}
            }
            @if !points.is_empty() {
                polyline class="backlog" points=(line(&backlog, top2, level_max)) {}
                polyline class="dead" points=(line(&dead, top2, level_max)) {}
                @for (x, v) in backlog.iter().rev().take(1) {
                    circle class="backlog" cx=(format!("{x:.1}")) cy=(format!("{:.1}", top2 + PANEL - v / level_max * PANEL)) r="3" {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(minute: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + minute * 60, 0).unwrap()
    }

    #[test]
    fn samples_turn_counters_into_per_minute_figures_and_keep_an_hour() {
        let mut samples = Samples::default();
        samples.push(at(0), 10, 1, Some((100, 5)));
        samples.push(at(1), 4, 2, Some((160, 9)));
        samples.push(at(2), 3, 2, None);
        samples.push(at(3), 3, 2, Some((200, 9)));
        let points = samples.points();
        assert_eq!(points[0].published, None);
        assert_eq!((points[1].published, points[1].failed), (Some(60), Some(4)));
        assert_eq!((points[2].published, points[2].failed), (None, None));
        // After a gap in the counters the next figure waits for a new baseline.
        assert_eq!(points[3].published, None);
        for minute in 4..100 {
            samples.push(at(minute), 0, 0, Some((200, 9)));
        }
        let points = samples.points();
        assert_eq!(points.len(), KEPT);
        assert_eq!(points[0].at, at(40));
        assert_eq!(points[KEPT - 1].at, at(99));
    }

    #[test]
    fn the_chart_draws_each_series_and_says_when_there_is_nothing_yet() {
        let empty = svg(&[], at(60)).into_string();
        assert!(empty.contains("collecting"), "{empty}");
        assert!(!empty.contains("<polyline"), "{empty}");

        let mut samples = Samples::default();
        samples.push(at(0), 10, 0, Some((0, 0)));
        samples.push(at(30), 20, 1, Some((50, 2)));
        samples.push(at(60), 0, 1, Some((150, 2)));
        let drawn = svg(&samples.points(), at(60)).into_string();
        for class in ["published", "failed", "backlog", "dead"] {
            assert!(drawn.contains(&format!("<polyline class=\"{class}\"")), "{class}: {drawn}");
        }
        // 50 half an hour ago (halfway across, half the panel's height), 100 now (the scale's top,
        // at the right edge).
        assert!(drawn.contains("<polyline class=\"published\" points=\"384.0,71.0 712.0,16.0\">"), "{drawn}");
    }
}

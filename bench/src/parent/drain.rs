//! The drain phase: a backlog emptied end to end unpaced, then paced (`--drain-rate`); the
//! rows done in each second of each are its [`DrainCurve`]s.

use std::sync::Mutex;

use diesel_async::AsyncPgConnection;

use super::Names;
use super::drain_curve::{CURVE_STEP, DrainCurve, per_second};
use super::phases::{Via, dispatch, seed, verify_done};
use super::tally::Tally;
use crate::{BoxError, Opts, RetentionArg};

/// Drains `--messages` rows unpaced, then paced at `--drain-rate`.
pub(super) async fn drain(
    opts: &Opts,
    names: &Names,
    db: &mut AsyncPgConnection,
    tally: &Mutex<Tally>,
) -> Result<Vec<DrainCurve>, BoxError> {
    let n = opts.messages;
    let mut curves = Vec::new();
    for cap in [None, Some(opts.drain_rate)] {
        let opts = Opts { max_rate: cap, ..opts.clone() };
        let first = seed(db, n, 0, &opts).await?;
        let mut peak_kib = 0;
        let spent = dispatch(&opts, names, Via::Direct, "rabbit", n, tally, first, &mut peak_kib).await?;
        verify_done(db, n, 0, opts.retention == RetentionArg::Delete).await?;
        curves.push(DrainCurve {
            max_rate: cap,
            seconds: spent.curve.len() as f64 * CURVE_STEP.as_secs_f64(),
            per_second: per_second(&spent.curve),
        });
    }
    Ok(curves)
}

//! The drain phase's curves: the rows done in each second of a drain, printed side by side
//! and drawn as an SVG plot.

use std::fmt::Write as _;

use std::time::Duration;

use serde::Serialize;

/// How often a dispatcher phase notes the rows done so far.
pub(super) const CURVE_STEP: Duration = Duration::from_millis(100);

/// One drain: its cap, how long it took, and the rows done in each of its seconds.
#[derive(Debug, Serialize)]
pub(super) struct DrainCurve {
    pub(super) max_rate: Option<f64>,
    pub(super) seconds: f64,
    pub(super) per_second: Vec<u64>,
}

/// Rows done in each second, from the running count noted every [`CURVE_STEP`].
pub(super) fn per_second(curve: &[u64]) -> Vec<u64> {
    let steps = (1.0 / CURVE_STEP.as_secs_f64()).round() as usize;
    let at = |i: usize| if i == 0 { 0 } else { curve[(i * steps).min(curve.len()) - 1] };
    (0..curve.len().div_ceil(steps)).map(|k| at(k + 1) - at(k)).collect()
}

fn label(cap: Option<f64>) -> String {
    cap.map_or("unpaced".to_owned(), |r| format!("--max-rate {r}"))
}

/// The two curves side by side, a line a second.
pub(super) fn print(curves: &[DrainCurve], messages: usize) {
    println!();
    println!("drain: {messages} rows end to end, rows done per second");
    for c in curves {
        println!(
            "  {:<18} {:>7.1} s  {:>8.0} rows/s overall",
            label(c.max_rate),
            c.seconds,
            messages as f64 / c.seconds
        );
    }
    print!("  {:>6}", "second");
    for c in curves {
        print!("  {:>18}", label(c.max_rate));
    }
    println!();
    let longest = curves.iter().map(|c| c.per_second.len()).max().unwrap_or(0);
    for k in 0..longest {
        print!("  {:>6}", k + 1);
        for c in curves {
            match c.per_second.get(k) {
                Some(n) => print!("  {n:>18}"),
                None => print!("  {:>18}", ""),
            }
        }
        println!();
    }
}

/// Both curves as an SVG line plot: rows done per second over seconds since the start.
pub(super) fn svg(curves: &[DrainCurve], messages: usize) -> String {
    const W: f64 = 720.0;
    const H: f64 = 320.0;
    const LEFT: f64 = 64.0;
    const BOTTOM: f64 = 40.0;
    const TOP: f64 = 36.0;
    const RIGHT: f64 = 16.0;
    const COLOURS: [&str; 2] = ["#c0392b", "#2471a3"];
    let seconds = curves.iter().map(|c| c.per_second.len()).max().unwrap_or(1).max(1) as f64;
    let peak = curves.iter().flat_map(|c| c.per_second.iter().copied()).max().unwrap_or(1).max(1) as f64;
    let y_top = nice_ceiling(peak);
    let x = |s: f64| LEFT + s / seconds * (W - LEFT - RIGHT);
    let y = |r: f64| H - BOTTOM - r / y_top * (H - BOTTOM - TOP);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="20" font-size="14">Draining {messages} rows end to end: rows done per second</text>"#
    );
    for i in 0..=4 {
        let r = y_top * f64::from(i) / 4.0;
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{r:.0}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y(r) + 4.0,
            y = y(r)
        );
    }
    let tick = nice_ceiling(seconds / 8.0).max(1.0);
    let mut s = 0.0;
    while s <= seconds {
        let _ = writeln!(out, r#"<text x="{:.1}" y="{}" text-anchor="middle">{s:.0}</text>"#, x(s), H - BOTTOM + 16.0);
        s += tick;
    }
    let _ = writeln!(out, r#"<text x="{:.1}" y="{}" text-anchor="middle">seconds</text>"#, (LEFT + W) / 2.0, H - 6.0);
    for (i, c) in curves.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        // Each second's count drawn at the middle of its second.
        let points: Vec<String> = c
            .per_second
            .iter()
            .enumerate()
            .map(|(k, n)| format!("{:.1},{:.1}", x(k as f64 + 0.5), y(*n as f64)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" fill="{colour}">{} ({:.1} s)</text>"#,
            W - RIGHT - 200.0,
            TOP + 14.0 + 16.0 * i as f64,
            label(c.max_rate),
            c.seconds
        );
    }
    out.push_str("</svg>\n");
    out
}

/// 1, 2 or 5 times a power of ten, at least `v`.
fn nice_ceiling(v: f64) -> f64 {
    let power = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * power).find(|c| *c >= v).unwrap_or(10.0 * power)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_second_counts_the_rows_done_in_each_second() {
        // Ten steps a second: 100 rows a step for a second, then 10 a step, then a half second.
        let mut curve = Vec::new();
        let mut done = 0;
        for step in 0..25 {
            done += if step < 10 { 100 } else { 10 };
            curve.push(done);
        }
        assert_eq!(per_second(&curve), vec![1000, 100, 50]);
        assert_eq!(nice_ceiling(1234.0), 2000.0);
        assert_eq!(nice_ceiling(0.8), 1.0);
    }
}

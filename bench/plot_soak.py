#!/usr/bin/env python3
"""Draws a soak of the bench as an SVG plot: commit -> consumer latency, the outbox's table and
index sizes, its dead tuples and the relay's resident memory, minute by minute.

    cargo run --release -p actix-outbox-bench -- --pg-own --phases soak --minutes 60 --json > soak.json
    python3 bench/plot_soak.py soak.json docs/soak.svg

The input is the bench's `--json` document (its `soak`), or that object alone; `-` reads stdin.
Python 3's standard library only.
"""

import json
import math
import sys
from xml.sax.saxutils import escape

WIDTH = 760
PANEL = 150
GAP = 46
LEFT = 78
RIGHT = 150
TOP = 60
MIB = 1048576.0


def nice_ceiling(v):
    """1, 2 or 5 times a power of ten, at least v (1 for nothing)."""
    if v <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        if m * power >= v:
            return m * power
    return 10 * power


def number(v):
    if v >= 10_000:
        return f"{v / 1000:.0f}k"
    if v >= 10 or v == 0:
        return f"{v:.0f}"
    return f"{v:g}"


def panel(out, index, title, unit, minutes, series):
    """One panel: series = [(label, colour, [value or None per minute])]."""
    top = TOP + index * (PANEL + GAP)
    bottom = top + PANEL
    span = max(minutes[-1], 1)
    peak = max([v for _, _, values in series for v in values if v is not None] or [0])
    y_top = nice_ceiling(peak * 1.05)

    # A minute's figures are those of its end.
    def x(m):
        return LEFT + m / span * (WIDTH - LEFT - RIGHT)

    def y(v):
        return bottom - v / y_top * PANEL

    out.append(f'<text x="{LEFT}" y="{top - 10}" font-size="13">{escape(title)} ({escape(unit)})</text>')
    for i in range(6):
        v = y_top * i / 5
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{number(v)}</text>')
    step = max(1, nice_ceiling(span / 10))
    m = 0
    while m <= span:
        out.append(f'<text x="{x(m):.1f}" y="{bottom + 15}" text-anchor="middle">{m:g}</text>')
        m += step
    for k, (label, colour, values) in enumerate(series):
        points = [f"{x(mi):.1f},{y(v):.1f}" for mi, v in zip(minutes, values) if v is not None]
        if points:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(points)}"/>')
        out.append(f'<text x="{WIDTH - RIGHT + 10}" y="{top + 14 + 16 * k}" fill="{colour}">{escape(label)}</text>')


def draw(soak):
    lines = soak["lines"]
    if not lines:
        raise SystemExit("the soak has no minute")
    minutes = [line["minute"] for line in lines]

    def latency(key):
        return [line["latency"][key] if line.get("latency") else None for line in lines]

    panels = [
        ("commit → consumer", "ms, rows delivered in the minute",
         [("p99", "#c0392b", latency("p99_ms")), ("p50", "#2471a3", latency("p50_ms"))]),
        ("the outbox's size", "MiB",
         [("table", "#7d3c98", [line["table_bytes"] / MIB for line in lines]),
          ("indexes", "#1e8449", [line["indexes_bytes"] / MIB for line in lines])]),
        ("the outbox's dead tuples", "at the minute's end", [("dead", "#b9770e", [line["dead_tuples"] for line in lines])]),
        ("the relay's resident memory", "MiB", [("RSS", "#34495e", [line["relay_rss_mib"] for line in lines])]),
    ]
    height = TOP + len(panels) * (PANEL + GAP) - GAP + 44
    args = " ".join(soak.get("relay_args") or []) or "defaults"
    title = (f"Soak: {soak['rate']} rows/s for {soak['minutes']} minutes, producer {soak['producer']}, "
             f"relay: actix-outbox run ({args})")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
           f'height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="{LEFT}" y="20" font-size="14">{escape(title)}</text>']
    for i, (name, unit, series) in enumerate(panels):
        panel(out, i, name, unit, minutes, series)
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{height - 8}" text-anchor="middle">minutes</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) != 3:
        raise SystemExit("usage: plot_soak.py SOAK.json|- OUT.svg")
    source = sys.stdin if sys.argv[1] == "-" else open(sys.argv[1], encoding="utf-8")
    document = json.load(source)
    soak = document.get("soak", document)
    if not soak or "lines" not in soak:
        raise SystemExit(f"{sys.argv[1]}: no soak in it (run the bench with --phases soak --json)")
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        f.write(draw(soak))


if __name__ == "__main__":
    main()

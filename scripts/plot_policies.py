"""Plot hit ratio against cache size for every eviction policy, with Belady's MIN, on each trace.

Replays the traces offline (the same code as `replay_trace.py offline`) at a range
of capacities and writes one SVG image with a chart per trace (no plotting library
needed), plus the numbers as a table on stdout.

    python scripts/plot_policies.py TRACE [TRACE ...] --out docs/eviction-curves.svg
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvfs.policy import POLICIES, make_policy  # noqa: E402
from kvfs.policy.replay import belady, capacities, load_trace, replay  # noqa: E402

FRACTIONS = [0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5]
COLOURS = {"MIN": "#333333", "lru": "#d62728", "reuse": "#1f77b4"}
WIDTH, HEIGHT, MARGIN = 440, 300, 50


def curves(trace: Path) -> dict[str, list[tuple[float, float]]]:
    requests = load_trace(trace)
    points: dict[str, list[tuple[float, float]]] = {name: [] for name in [*sorted(POLICIES), "MIN"]}
    for fraction, blocks in capacities(requests, FRACTIONS):
        for name in sorted(POLICIES):
            points[name].append((fraction, replay(requests, blocks, make_policy(name))))
        points["MIN"].append((fraction, belady(requests, blocks)))
        print(f"{trace.name} {fraction:.2f} " + " ".join(f"{n}={v[-1][1]:.4f}" for n, v in points.items()),
              file=sys.stderr, flush=True)
    return points


def chart(title: str, points: dict[str, list[tuple[float, float]]], left: int) -> list[str]:
    top = 30
    x_max, y_max = max(FRACTIONS), max(v for line in points.values() for _, v in line) * 1.1

    def xy(fraction: float, value: float) -> tuple[float, float]:
        return (left + MARGIN + fraction / x_max * (WIDTH - MARGIN - 10),
                top + HEIGHT - MARGIN - value / y_max * (HEIGHT - MARGIN - 10))

    out = [f'<text x="{left + WIDTH / 2}" y="{top - 10}" text-anchor="middle" font-size="14">{title}</text>']
    x0, y0 = xy(0, 0)
    x1, y1 = xy(x_max, y_max)
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>')
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>')
    for fraction in FRACTIONS:
        x, _ = xy(fraction, 0)
        out.append(f'<text x="{x}" y="{y0 + 15}" text-anchor="middle" font-size="10">{fraction:.0%}</text>')
    for step in range(6):
        value = y_max * step / 5
        _, y = xy(0, value)
        out.append(f'<text x="{x0 - 5}" y="{y + 3}" text-anchor="end" font-size="10">{value:.2f}</text>')
    out.append(f'<text x="{left + WIDTH / 2}" y="{y0 + 32}" text-anchor="middle" font-size="11">'
               'cache size (share of unique blocks)</text>')
    out.append(f'<text x="{left + 12}" y="{top + HEIGHT / 2 - 20}" font-size="11" '
               f'transform="rotate(-90 {left + 12} {top + HEIGHT / 2 - 20})" text-anchor="middle">'
               'prefix hit ratio</text>')
    for index, (name, line) in enumerate(points.items()):
        colour = COLOURS.get(name, "#2ca02c")
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(f, v) for f, v in line))
        dash = ' stroke-dasharray="5,3"' if name == "MIN" else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{x0 + 10}" y="{y1 + 12 + 14 * index}" font-size="11" fill="{colour}">{name}</text>')
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--out", default="docs/eviction-curves.svg")
    args = parser.parse_args()
    body: list[str] = []
    for index, trace in enumerate(map(Path, args.traces)):
        body += chart(trace.stem, curves(trace), index * WIDTH)
    width = WIDTH * len(args.traces)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{HEIGHT + 40}" '
           f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>', *body, "</svg>"]
    Path(args.out).write_text("\n".join(svg) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

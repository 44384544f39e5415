"""A line chart as a standalone SVG file, for the loss curves docs/benchmarks.md shows.

The benchmarks plot a few series of (x, y) points (validation loss against tokens, say); the chart needs no
plotting library: a polyline per series inside linear axes, five ticks per axis and a legend. Open the file
in a browser or reference it from Markdown (``![title](bench/results/x.svg)``).
"""

from __future__ import annotations

from html import escape
from pathlib import Path

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 40, 50  # margins: ticks left and below, legend on the right
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def _span(values: list[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if low == high:  # one value: give the axis some room around it
        pad = abs(low) * 0.05 or 1.0
        return low - pad, high + pad
    return low, high


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str) -> str:
    """The SVG text of one chart; ``series`` maps a legend label to its points in x order."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        raise ValueError("line_chart needs at least one point")
    (x0, x1), (y0, y1) = _span([p[0] for p in points]), _span([p[1] for p in points])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return TOP + (y1 - y) / (y1 - y0) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>',
    ]
    for x in _ticks(x0, x1):
        out.append(f'<text x="{sx(x):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{x:.4g}</text>')
    for y in _ticks(y0, y1):
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(
        f'<text x="16" y="{TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {TOP + plot_h / 2})">{escape(ylabel)}</text>'
    )
    for i, (label, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        ly = TOP + 14 + 18 * i
        out.append(
            f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 36}" y1="{ly}" y2="{ly}" stroke="{color}" '
            'stroke-width="2"/>'
        )
        out.append(f'<text x="{WIDTH - RIGHT + 42}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_line_chart(path: str | Path, series: dict[str, list[tuple[float, float]]], **labels: str) -> Path:
    """Write :func:`line_chart` to ``path`` (title=, xlabel=, ylabel= as keywords) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(line_chart(series, labels["title"], labels["xlabel"], labels["ylabel"]))
    return path

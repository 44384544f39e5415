"""bench/svg_plot.py: points land where the axes say, labels are escaped, empty input is refused."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import svg_plot  # noqa: E402


def test_points_map_onto_the_plot_area_and_labels_are_escaped(tmp_path):
    series = {"adam <lr 1e-3>": [(0, 10.0), (50, 5.0), (100, 0.0)], "sgd": [(0, 10.0), (100, 10.0)]}
    path = svg_plot.write_line_chart(tmp_path / "c.svg", series, title="loss & tokens", xlabel="t", ylabel="l")
    svg = path.read_text()
    lines = re.findall(r'<polyline points="([^"]+)"', svg)
    assert len(lines) == 2
    first = [tuple(map(float, p.split(","))) for p in lines[0].split()]
    plot_w = svg_plot.WIDTH - svg_plot.LEFT - svg_plot.RIGHT
    plot_h = svg_plot.HEIGHT - svg_plot.TOP - svg_plot.BOTTOM
    # x 0..100 spans the plot's width; y 10 is the top edge, y 0 the bottom edge, y 5 halfway
    assert first == [
        (svg_plot.LEFT, svg_plot.TOP),
        (svg_plot.LEFT + plot_w / 2, svg_plot.TOP + plot_h / 2),
        (svg_plot.LEFT + plot_w, svg_plot.TOP + plot_h),
    ]
    assert "adam &lt;lr 1e-3&gt;" in svg and "loss &amp; tokens" in svg
    with pytest.raises(ValueError, match="at least one point"):
        svg_plot.line_chart({}, "t", "x", "y")

"""The `ettr simulate --html` page: self-contained, and it draws what it is given."""

from __future__ import annotations

from pathlib import Path

from ettr.simulate.html import render_simulate_html, write_simulate_html
from ettr.simulate.params import JobParams
from ettr.simulate.summary import simulate
from ettr.simulate.sweep import sweep_interval


def test_sweep_page_marks_the_optimum_and_is_self_contained(tmp_path: Path) -> None:
    params = JobParams(failures_per_node_day=3.0, blocking_s=15.0, interval_s=900.0, duration_s=86_400.0)
    sweep = sweep_interval(params, [300.0, 900.0, 2700.0], runs=5, seed=0)
    page = render_simulate_html(
        title="t <&>", sweep=sweep, summaries=[("given", simulate(params, runs=3, seed=0))]
    )
    assert "t &lt;&amp;&gt;" in page and "ETT by interval" in page and "model optimum" in page
    assert "<polyline" in page and "Where the wall time goes" in page
    assert 'src="http' not in page and "<link" not in page
    target = tmp_path / "sim.html"
    write_simulate_html(target, title="x", summaries=[("given", sweep.best.summary)])
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")

"""The checkpoint-interval model and `ettr interval`."""

from __future__ import annotations

import json

import pytest

from ettr.cli import main
from ettr.interval import IntervalModel, curve, optimal_interval_s


def test_source_article_example():
    model = IntervalModel(blocking_s=15, failures_per_day=3)
    assert model.optimal_interval_s / 60 == pytest.approx(15.49, abs=0.01)
    assert model.wasted_pct(model.optimal_interval_s) == pytest.approx(3.227, abs=0.001)


def test_optimum_is_a_minimum_and_terms_balance():
    model = IntervalModel(blocking_s=4.0, failures_per_day=7, train_hours=10)
    best = model.optimal_interval_s
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert model.wasted_s(best * factor) > model.wasted_s(best)
    assert model.failures_per_day * best / 2 == pytest.approx(model.train_s / best * model.blocking_s)
    assert optimal_interval_s(4.0, 7, 10) == best


def test_daly_is_close_to_young_for_cheap_saves_and_capped_for_expensive_ones():
    cheap = IntervalModel(blocking_s=1, failures_per_day=1)
    assert cheap.daly_interval_s == pytest.approx(cheap.optimal_interval_s, rel=0.01)
    dear = IntervalModel(blocking_s=50_000, failures_per_day=10)
    assert dear.daly_interval_s == dear.mtbf_s


def test_curve_is_symmetric_in_log_interval():
    points = curve(IntervalModel(blocking_s=15, failures_per_day=3))
    wasted = [w for _, w in points]
    assert wasted == pytest.approx(list(reversed(wasted)))
    assert min(wasted) == wasted[len(wasted) // 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"blocking_s": 0, "failures_per_day": 1},
        {"blocking_s": 1, "failures_per_day": 0},
        {"blocking_s": 1, "failures_per_day": 1, "train_hours": 25},
    ],
)
def test_bad_model_inputs_say_why(kwargs):
    with pytest.raises(ValueError, match="must be"):
        IntervalModel(**kwargs)


def test_cli_json(capsys):
    assert main(["interval", "--blocking", "15", "--failures-per-day", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["optimal_interval_s"] == pytest.approx(929.5, abs=0.1)
    assert out["wasted_pct"] == pytest.approx(3.23, abs=0.01)


def test_cli_text_shows_the_curve(capsys):
    assert main(["interval", "--blocking", "15", "--failures-per-day", "3"]) == 0
    out = capsys.readouterr().out
    assert "15.5 min" in out and "3.23%" in out and "<- optimum" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["interval", "--blocking", "abc", "--failures-per-day", "3"],
        ["interval", "--blocking", "-1", "--failures-per-day", "3"],
        ["interval", "--failures-per-day", "3"],
        ["interval", "--blocking", "15", "--failures-per-day", "3", "--train-hours", "30"],
    ],
)
def test_cli_bad_input_is_one_line_and_status_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err

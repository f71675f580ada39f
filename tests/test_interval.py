"""The checkpoint-interval model and `ettr interval`."""

from __future__ import annotations

import json

import pytest

from ettr.cli import main
from ettr.interval import (
    IntervalModel,
    curve,
    daly_interval_s,
    optimal_interval_s,
    wasted_fraction,
    young_interval_s,
)


def test_source_article_example():
    """The article's first-order numbers are Young's; the model's exact optimum is ~1% shorter and wastes a
    few hundredths of a point less (b/M = 15 s / 8 h is small)."""
    model = IntervalModel(blocking_s=15, failures_per_day=3)
    assert model.young_interval_s / 60 == pytest.approx(15.49, abs=0.01)
    assert model.optimal_interval_s / 60 == pytest.approx(15.33, abs=0.01)
    assert model.wasted_pct(model.optimal_interval_s) == pytest.approx(3.19, abs=0.01)


def test_optimum_is_a_minimum():
    model = IntervalModel(blocking_s=4.0, failures_per_day=7, train_hours=10)
    best = model.optimal_interval_s
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert model.wasted_s(best * factor) > model.wasted_s(best)


def test_one_model_behind_ettr_interval_auto_and_the_simulator():
    """docs/interval.md's worked example (300 s per save, 48 failures a day): `ettr interval`, the checkpoint
    manager's `auto` interval and `ettr simulate --interval auto` give the same interval, Daly's to 0.5%."""

    from ettr.checkpoint.policy import IntervalConfig, IntervalPolicy
    from ettr.simulate.analytic import optimal_interval_for
    from ettr.simulate.params import JobParams

    model = IntervalModel(blocking_s=300, failures_per_day=48)
    best = model.optimal_interval_s
    assert best == pytest.approx(850, abs=1)
    assert best == pytest.approx(model.daly_interval_s, rel=0.005)
    assert model.young_interval_s == pytest.approx(1039, abs=1)  # first order: b / M = 1/6 is not small

    policy = IntervalPolicy(IntervalConfig(auto=True, failures_per_day=48), now_s=0.0)
    policy.observe_save(cost_s=300.0, now_s=0.0)
    assert policy.interval_s(0.0) == pytest.approx(best, rel=1e-6)

    job = JobParams(gpus=8, failures_per_node_day=48, blocking_s=300, restart_gap_s=600, interval_s=600)
    assert optimal_interval_for(job) == pytest.approx(best, rel=1e-6)


def test_cli_simulate_and_interval_agree(capsys):
    import json

    assert main(["interval", "--blocking", "300", "--failures-per-day", "48", "--json"]) == 0
    interval = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    argv = [
        "simulate",
        "--failures-per-node-day",
        "48",
        "--checkpoint-blocking-s",
        "300",
        "--interval",
        "auto",
    ]
    assert main([*argv, "--runs", "2", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["interval_s"] == pytest.approx(interval["optimal_interval_s"], rel=1e-6)
    assert interval["young_interval_s"] == pytest.approx(1039.2, abs=0.1)


def test_restart_cost_raises_the_waste_not_the_optimum():
    args = {"save_cost_s": 30.0, "failures_per_day": 10.0}
    assert optimal_interval_s(**args, restart_s=600.0) == optimal_interval_s(**args)
    best = optimal_interval_s(**args)
    cheap = wasted_fraction(interval_s=best, save_cost_s=30.0, failures_per_day=10.0)
    dear = wasted_fraction(interval_s=best, save_cost_s=30.0, failures_per_day=10.0, restart_s=600.0)
    assert dear > cheap
    for factor in (0.8, 1.25):
        other = wasted_fraction(
            interval_s=best * factor, save_cost_s=30.0, failures_per_day=10.0, restart_s=600.0
        )
        assert other > dear


def test_a_persist_slowdown_counts_as_save_cost_and_a_persist_floors_the_interval():
    plain = optimal_interval_s(save_cost_s=1.0, failures_per_day=5.0)
    assert optimal_interval_s(
        save_cost_s=1.0, failures_per_day=5.0, slowdown_s_per_save=9.0
    ) == pytest.approx(optimal_interval_s(save_cost_s=10.0, failures_per_day=5.0))
    assert optimal_interval_s(save_cost_s=1.0, failures_per_day=5.0, min_interval_s=10 * plain) == 10 * plain


def test_young_and_daly_are_the_models_first_orders():
    for save_cost_s, per_day in ((1.0, 1.0), (15.0, 3.0), (300.0, 48.0)):
        mtbf_s = 86_400 / per_day
        exact = optimal_interval_s(save_cost_s=save_cost_s, failures_per_day=per_day)
        ratio = save_cost_s / mtbf_s
        # Young is off by about sqrt(b / 2M) / 3 (Daly's next term), Daly by far less.
        assert young_interval_s(save_cost_s=save_cost_s, mtbf_s=mtbf_s) == pytest.approx(
            exact, rel=ratio**0.5
        )
        assert daly_interval_s(save_cost_s=save_cost_s, mtbf_s=mtbf_s) == pytest.approx(exact, rel=ratio)
    dear = IntervalModel(blocking_s=50_000, failures_per_day=10)
    assert dear.daly_interval_s == dear.mtbf_s


def test_curve_has_its_minimum_at_the_optimum():
    points = curve(IntervalModel(blocking_s=15, failures_per_day=3))
    wasted = [w for _, w in points]
    assert min(wasted) == wasted[len(wasted) // 2]
    assert wasted[0] > wasted[1] and wasted[-1] > wasted[-2]


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
    assert out["optimal_interval_s"] == pytest.approx(919.5, abs=0.1)
    assert out["wasted_pct"] == pytest.approx(3.19, abs=0.01)
    assert out["young_interval_s"] == pytest.approx(929.5, abs=0.1)


def test_cli_text_shows_the_curve(capsys):
    assert main(["interval", "--blocking", "15", "--failures-per-day", "3"]) == 0
    out = capsys.readouterr().out
    assert "15.3 min" in out and "3.19%" in out and "<- optimum" in out


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


@pytest.mark.parametrize(
    ("save_cost_s", "failures_per_day"), [(1.0, 5e-324), (1e300, 1.0), (1.0, 1e300), (1e-300, 1e300)]
)
def test_pairs_out_of_range_are_its_value_error_not_an_overflow(save_cost_s, failures_per_day):
    """A rate whose mean gap overflows, or a save hundreds of failure times long: the documented ValueError
    (callers turn it into one line), never OverflowError or ZeroDivisionError."""
    from ettr.interval import optimal_interval_s

    with pytest.raises(ValueError):
        optimal_interval_s(save_cost_s=save_cost_s, failures_per_day=failures_per_day)

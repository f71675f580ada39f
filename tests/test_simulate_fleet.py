"""The fleet experiment's victim choice and its result on the same seeded fleets."""

from __future__ import annotations

import numpy as np
import pytest

from ettr.simulate.fleet import FleetParams, choose_victims, fleet_experiment


def test_lowest_cost_takes_the_cheapest_jobs_until_enough_gpus_are_free() -> None:
    running = np.array([10, 11, 12, 13])
    gpus = np.array([64.0, 8.0, 8.0, 128.0])
    unsaved = np.array([100.0, 3000.0, 10.0, 5.0])
    recovery = np.array([60.0, 60.0, 60.0, 60.0])
    # Costs: 10240, 24480, 560, 8320 GPU-s -> 12, 13 (136 GPUs >= 100).
    rng = np.random.default_rng(0)
    assert choose_victims("lowest_cost", running=running, unsaved_s=unsaved, recovery_s=recovery, gpus=gpus,
                          need_gpus=100, rng=rng) == [12, 13]  # fmt: skip
    picked = choose_victims("random", running=running, unsaved_s=unsaved, recovery_s=recovery, gpus=gpus,
                            need_gpus=100, rng=rng)  # fmt: skip
    assert sum(gpus[running.tolist().index(j)] for j in picked) >= 100 and len(set(picked)) == len(picked)
    with pytest.raises(ValueError, match="unknown victim policy"):
        choose_victims("oldest", running=running, unsaved_s=unsaved, recovery_s=recovery, gpus=gpus,
                       need_gpus=1, rng=rng)  # fmt: skip


def test_lowest_cost_loses_fewer_gpu_hours_on_the_same_fleets() -> None:
    out = fleet_experiment(FleetParams(duration_s=2 * 86_400.0), runs=8, seed=5)
    random, cheapest = out["policies"]["random"], out["policies"]["lowest_cost"]
    assert cheapest["lost_gpu_hours"] < random["lost_gpu_hours"]
    assert 0 < random["ett_pct"] < cheapest["ett_pct"] <= 100


def test_bad_fleet_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        FleetParams(num_jobs=0)
    with pytest.raises(ValueError):
        FleetParams(interval_s=(0.0, 10.0))

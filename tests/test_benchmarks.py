"""Every benchmark still runs: each script in benchmarks/ (found, not listed, so a new one is covered at once) in
its quick mode, `--quick --json`, exits 0 and ends with one JSON object holding the figures it is judged by.

The figures' values are not judged here (timings belong to the benchmarks, never to tests); only that each named
figure is there and is a real number (or the object it names), so that a benchmark which rots -- an import that
moved, a figure that is no longer computed -- fails CI. The convention is in benchmarks/README.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# The figures of each benchmark's JSON line that its issue names ("a.b" is b inside the object a). A new script in
# benchmarks/ fails test_every_benchmark_is_listed until its figures are added here.
FIGURES: dict[str, tuple[str, ...]] = {
    "accounting_scale.py": (
        "report_250k_s", "report_500k_s", "report_1m_s", "ratio_1m_over_250k", "to_dict_1m_s", "render_1m_s",
        "num_segments_1m",
    ),
    "bootstrap_overhead.py": (
        "startup_plain_s", "startup_outside_run_s", "startup_worker_s", "startup_instrumented_s",
        "import_torch_plain_s", "import_torch_instrumented_s", "import_torch_overhead_ratio",
        "optimizer_step_plain_us", "optimizer_step_hooked_us", "step_hook_overhead_us",
        "save_bytesio_plain_us", "save_bytesio_hooked_us", "save_hook_overhead_us", "module_train_overhead_us",
        "evaluation_overhead_us",
    ),
    "checkpoint_faults.py": ("trials", "bad_resumes", "stale_resumes", "by_kind", "disk", "killed_mid_persist"),
    "checkpoint_stall.py": (
        "blocking_s.torch_save", "blocking_s.dcp_save", "blocking_s.dcp_async_save", "blocking_s.ettr",
        "blocking_s.ettr_no_overlap", "blocking_s.memcpy_limit", "step_slowdown.thread", "step_slowdown.process",
        "report_step_slowdown.thread", "report_step_slowdown.process", "ratios.ettr_over_memcpy",
        "ratios.torch_save_over_ettr",
    ),
    "compile_store.py": (
        "store_bytes", "unshared_bytes", "size_ratio", "first_save_s", "later_save_s_median",
        "later_unshared_save_s_median",
    ),
    "compile_start.py": (
        "first_step_s.cold", "first_step_s.megacache", "first_step_s.ettr_store", "tts_s.sequential",
        "tts_s.overlapped", "tts_s.longest_phase", "ratios.ettr_store_over_cold",
        "ratios.overlapped_over_longest_phase",
    ),
    "fleet_scale.py": (
        "num_jobs", "num_events", "fleet_s", "events_per_s", "fleet_cached_s", "scrape_cold_s", "scrape_warm_s",
        "num_series",
    ),
    "header_restore.py": (
        "every_variant_s", "wanted_variants_s", "every_variant_bytes", "wanted_variants_bytes",
        "ratio_wanted_over_every_s",
    ),
    "ledger_scale.py": (
        "append_events_per_s_postgres", "append_events_per_s_sqlite", "report_s_postgres", "report_s_sqlite",
        "event_cost_us_postgres", "event_cost_us_sqlite", "event_cost_us_memory", "spill_catch_up_s",
        "spill_spilled_events",
    ),
    "publish_anchor.py": (
        "written_publish_phase_s", "linked_publish_phase_s", "saved_s", "linked_publish_phase_max_s", "num_linked",
    ),
    "publish_shutdown.py": (
        "inside_shutdown_s", "standalone_shutdown_s", "shutdown_ratio", "saved_s_per_job", "publish_job_wall_s",
    ),
    "recorder_overhead.py": (
        "event_cost_us", "phase_cost_us", "backward_hook_cost_us", "step_with_arrival_cost_us",
        "report_1m_events_s", "ledger_write_1m_events_s",
    ),
    # Plain torchrun's own recovery is a result, not ettr's to guarantee (under load it sometimes fails): its
    # trial count is checked, ettr's recovery and its parts are figures.
    "recovery.py": (
        "faults.crash.torchrun.recovered", "faults.crash.ettr.median_ttr_s", "faults.crash.ettr.parts_median_s",
        "faults.crash.ettr_memory.median_ttr_s", "faults.crash.ettr_memory.restored_from",
        "faults.crash.ettr_inplace.median_ttr_s", "faults.crash.ettr_inplace.parts_median_s", "bad_resumes",
        "kill_trials.trials", "kill_trials.bad_resumes", "kill_trials.completed", "kill_trials.landed",
    ),
    "simulate_speed.py": (
        "scale_s", "scale_job_days_per_s", "scale_interruptions", "scalar_scale_s", "scale_speedup", "big_s",
        "big_job_days_per_s", "big_interruptions", "scalar_big_s", "big_speedup", "sweep_s", "sweep_job_days_per_s",
    ),
    "training_yield.py": (
        "slowdown.persist_thread", "slowdown.persist_process", "slowdown.standby", "slowdown.compile_store",
        "slowdown.compile_store_unlowered",
        "slowdown.ledger", "worst", "burners",
    ),
    "spare_kills.py": (
        "trials", "completed", "gave_up", "gave_up_after_last_step", "bad_resumes", "states_checked", "bad_states",
        "left_behind", "kills.rank", "kills.spare", "trials_without_kill", "spares_promoted", "spare_kills_failed",
        "tier_restores",
    ),
    "standby_race.py": (
        "busy.standby.median_ttr_s", "busy.off.median_ttr_s", "busy.ratio", "quiet.standby.median_ttr_s",
        "quiet.off.median_ttr_s", "quiet.ratio",
    ),
}  # fmt: skip

# Quick modes that start real jobs, compile, or a database server: minutes on a loaded machine (`make test-fast`
# leaves them out; `make test` runs them).
SLOW = {
    "accounting_scale.py", "checkpoint_faults.py", "checkpoint_stall.py", "compile_start.py", "compile_store.py",
    "fleet_scale.py", "ledger_scale.py", "publish_anchor.py", "publish_shutdown.py", "recovery.py", "spare_kills.py", "standby_race.py",
    "training_yield.py",
}  # fmt: skip
NEEDS_POSTGRES = {"ledger_scale.py"}
QUICK_TIMEOUT_S = 1200


def _scripts() -> list[str]:
    """Every benchmark: the scripts directly in benchmarks/ (the jobs they run live in benchmarks/jobs/)."""
    return sorted(path.name for path in BENCHMARKS.glob("*.py"))


def _figure(found: dict, dotted: str) -> object:
    value: object = found
    for name in dotted.split("."):
        assert isinstance(value, dict) and name in value, f"no figure {dotted!r} in {sorted(found)}"
        value = value[name]
    return value


def test_every_benchmark_is_listed() -> None:
    scripts = _scripts()
    assert scripts, "no benchmarks found"
    unlisted = [name for name in scripts if name not in FIGURES]
    assert not unlisted, (
        f"benchmarks {unlisted} have no entry in FIGURES of {Path(__file__).name}: give each a --quick mode and "
        "list the figures of its --json line there (benchmarks/README.md)"
    )
    gone = sorted(set(FIGURES) - set(scripts))
    assert not gone, f"FIGURES lists benchmarks that are not in benchmarks/: {gone}"


@pytest.mark.timeout(QUICK_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in _scripts()]
)
def test_quick_mode_ends_with_its_figures(name: str, tmp_path: Path) -> None:
    if name not in FIGURES:
        pytest.fail(f"{name} is not in FIGURES (see test_every_benchmark_is_listed)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    try:
        done = subprocess.run(
            [sys.executable, str(BENCHMARKS / name), "--quick", "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=QUICK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name} --quick ran past {QUICK_TIMEOUT_S} s; stderr: {str(exc.stderr)[-2000:]}")
    if name in NEEDS_POSTGRES and done.returncode == 2 and "no PostgreSQL server" in done.stderr:
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but {name} found no PostgreSQL server: {done.stderr.strip()}")
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, f"{name} --quick exited {done.returncode}:\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    assert lines, f"{name} printed nothing on stdout"
    try:
        found = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        pytest.fail(f"{name}'s last line is not one JSON object ({exc}): {lines[-1][:300]!r}")
    assert isinstance(found, dict), f"{name}'s last line is JSON but not an object"
    assert found.get("quick") is True, f"{name}'s JSON does not say it ran in quick mode"
    for dotted in FIGURES[name]:
        value = _figure(found, dotted)
        assert value is not None, f"{name}: figure {dotted} is null"
        if isinstance(value, float):
            assert math.isfinite(value), f"{name}: figure {dotted} is {value}"

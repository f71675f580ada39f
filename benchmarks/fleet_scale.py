"""How `ettr fleet` scales: a fleet of synthetic jobs (1,000 by default) in run directories, written through
the ledger API and cached under a temporary directory, then `ettr fleet DIR --json` timed as a user runs it
(a subprocess, median of `--runs`), and `/metrics` scraped from `ettr serve`'s server with every job known:
the first scrape reads every ledger, later ones come from the cache of finished jobs.

The issue's goal is 10M events over 1,000 jobs in under 10 s (`--events 10000000`; generating that once
takes a while). The default, 1M events, keeps the run to a few minutes on a loaded machine. `--json` ends
with one object: num_jobs, num_events, workers, fleet_s (median, every ledger read), fleet_runs_s, events_per_s, fleet_cached_s (finished jobs from the
cache of a previous run),
fleet_sequential_s (one worker, for the ratio), parallel_speedup, scrape_cold_s, scrape_warm_s (median),
metrics_bytes, num_series, generate_s (null when the cache was reused), goal_10m_events_under_10s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ettr.atomic import atomic_write
from ettr.testing.fleet import JobSpec, write_job

T0 = 1_750_000_000.0
FAMILIES = ("pretrain", "finetune", "dlrm", "eval", "rl")


def _spec(i: int, events_per_job: int) -> JobSpec:
    # One STEP per rank per step, a commit and a blocking span every 50 steps, and ~20 more per attempt.
    world_size = (1, 2, 8)[i % 3]
    steps = max(10, int((events_per_job - 20 - 2 * world_size) / (world_size + 0.04)))
    return JobSpec(
        job_id=f"job-{i:05d}",
        family=FAMILIES[i % len(FAMILIES)],
        start_ts=T0 + i * 600.0,
        world_size=world_size,
        num_steps=steps,
        step_s=0.2,
        ckpt_every=50,
        compile_s=30.0 * (2.0 if FAMILIES[i % len(FAMILIES)] == "dlrm" and i > 800 else 1.0),
        fail_at_steps=(steps // 2,) if i % 17 == 0 else (),
        failure_kind=("user", "infra", "preemption", "hang")[i % 4],
    )


def _write(args: tuple[Path, int, int]) -> int:
    root, i, per_job = args
    write_job(root / f"job-{i:05d}", _spec(i, per_job), batch=200_000)
    return i


def generate(root: Path, num_jobs: int, num_events: int, workers: int) -> float | None:
    marker = root / "COMPLETE.json"
    params = {"num_jobs": num_jobs, "num_events": num_events, "version": 2}
    if marker.is_file() and json.loads(marker.read_text()) == params:
        return None
    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("job-*/ledger.db*"):
        stale.unlink()
    per_job = num_events // num_jobs
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_write, [(root, i, per_job) for i in range(num_jobs)], chunksize=8))
    atomic_write(marker, json.dumps(params))
    return time.perf_counter() - start


def _fleet_cli(root: Path, *flags: str) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "ettr.cli", "fleet", str(root), "--json", *flags]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"ettr fleet failed: {done.stderr[-2000:]}")
    return elapsed, json.loads(done.stdout)


def _scrape(port: int) -> tuple[float, bytes]:
    start = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=600) as response:
        body = response.read()
    return time.perf_counter() - start, body


def count_events(root: Path) -> int:
    """Events actually in the fleet's ledgers."""
    import sqlite3

    total = 0
    for db in sorted(root.glob("job-*/ledger.db")):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            total += conn.execute("SELECT count(*) FROM events").fetchone()[0]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--events", type=int, default=1_000_000, help="total events over all jobs")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of ettr fleet (median)")
    parser.add_argument("--cache-dir", help="where the synthetic fleet is kept (default: a temp dir)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the one-worker run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workers = max(1, (os.cpu_count() or 1) // 2)  # what ettr fleet uses by default
    root = Path(args.cache_dir or Path(tempfile.gettempdir()) / f"ettr-fleet-bench-{args.jobs}-{args.events}")
    generate_s = generate(root, args.jobs, args.events, os.cpu_count() or 1)
    print(f"fleet of {args.jobs} jobs / {args.events} events in {root}"
          + (f" (generated in {generate_s:.1f} s)" if generate_s else " (cached)"), file=sys.stderr)  # fmt: skip

    num_events = count_events(root)
    runs = []
    out: dict = {}
    for _ in range(args.runs):
        elapsed, out = _fleet_cli(root, "--no-cache")
        runs.append(elapsed)
        print(f"  ettr fleet --json (every ledger read): {elapsed:.2f} s", file=sys.stderr)
    assert len(out["jobs"]) == args.jobs, len(out["jobs"])
    sequential = None
    if not args.no_sequential and workers > 1:
        sequential, _ = _fleet_cli(root, "--no-cache", "--workers", "1")
        print(f"  ettr fleet --json --workers 1: {sequential:.2f} s", file=sys.stderr)
    with tempfile.TemporaryDirectory() as cache:
        _fleet_cli(root, "--cache-dir", cache)  # fills the cache of finished jobs
        warm_runs = [_fleet_cli(root, "--cache-dir", cache)[0] for _ in range(args.runs)]
    print(
        f"  ettr fleet --json (finished jobs cached): {statistics.median(warm_runs):.2f} s", file=sys.stderr
    )

    from ettr.fleet.serve import loader, start_server

    server = start_server(
        loader(argparse.Namespace(run_dirs=[str(root)], ledger=None, workers=None, no_cache=True)),
        port=0,
        addr="127.0.0.1",
    )
    try:
        cold, body = _scrape(server.port)
        warm = [_scrape(server.port)[0] for _ in range(3)]
    finally:
        server.close()
    num_series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    fleet_s = statistics.median(runs)
    result = {
        "num_jobs": args.jobs,
        "num_events": num_events,
        "workers": workers,
        "fleet_s": fleet_s,
        "fleet_runs_s": runs,
        "events_per_s": num_events / fleet_s,
        "fleet_cached_s": statistics.median(warm_runs),
        "fleet_sequential_s": sequential,
        "parallel_speedup": sequential / fleet_s if sequential else None,
        "scrape_cold_s": cold,
        "scrape_warm_s": statistics.median(warm),
        "metrics_bytes": len(body),
        "num_series": num_series,
        "generate_s": generate_s,
        "fleet_ett_pct": out["ett_pct"],
        "num_regressions": len(out["regressions"]),
        "goal_10m_events_under_10s": (fleet_s < 10.0) if args.events >= 10_000_000 else None,
    }
    print(
        f"ettr fleet over {args.jobs} jobs / {num_events} events: {fleet_s:.2f} s median "
        f"({num_events / fleet_s / 1e6:.2f} M events/s, {workers} workers"
        + (f"; 1 worker {sequential:.2f} s, x{sequential / fleet_s:.2f}" if sequential else "")
        + f"); /metrics {cold:.2f} s cold, {statistics.median(warm) * 1000:.0f} ms warm, {num_series} series",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

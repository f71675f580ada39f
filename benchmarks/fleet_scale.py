"""How `ettr fleet` scales: a fleet of synthetic jobs (1,000 by default) in run directories and in a
PostgreSQL ledger, written through the real write path and kept under a temporary directory, then
`ettr fleet DIR --json` / `ettr fleet --ledger URL --json` timed as a user runs it (a subprocess, median of
`--runs`, no cache of earlier runs), and `/metrics` scraped from `ettr serve`'s server with every job known.

The write path is a real job's: events appended through the ledger API (`SqliteLedger.append`, or
`PostgresLedger.append`'s COPY) in batches, then `ettr.fleet.stored.store_at_job_end` -- the one call the
supervisor makes at job end, which accounts the finished job once and stores its summary next to its events
(keyed by the rows it was computed from). The fleet's first read uses those summaries; `fleet_from_events_s`
is the same command with `--from-events` (every job accounted from its events, as before summaries existed).

The issue's goal is 10M events over 1,000 jobs in under 10 s (`--events 10000000`; generating that once
takes a while). The default, 1M events, keeps the run to a few minutes on a loaded machine. `--json` ends
with one object: num_jobs, num_events, workers, fleet_s (median, every ledger read), fleet_runs_s, events_per_s, fleet_cached_s (finished jobs from the
cache of a previous run),
fleet_sequential_s (one worker, for the ratio), parallel_speedup, scrape_cold_s, scrape_warm_s (median),
metrics_bytes, num_series, generate_s (null when the cache was reused), goal_10m_events_under_10s, quick.
`--quick` (what CI runs): 20 jobs / 20,000 events, one timed run, generated afresh in a temporary directory
that is removed at the end (the PostgreSQL half too, when a server can be started here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ettr.atomic import atomic_write
from ettr.fleet.stored import store_at_job_end
from ettr.testing.fleet import JobSpec, write_job, write_job_url

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


WRITE_PATH = "ledger API appends in batches, then ettr.fleet.stored.store_at_job_end (the supervisor's call at job end)"


def _write(args: tuple[Path, int, int]) -> int:
    root, i, per_job = args
    write_job(root / f"job-{i:05d}", _spec(i, per_job), batch=200_000)
    return i


def _close(run_dir: Path) -> None:
    store_at_job_end(run_dir, ledger_url=None, job_id=run_dir.name)


def generate(root: Path, num_jobs: int, num_events: int, workers: int) -> float | None:
    marker = root / "COMPLETE.json"
    params = {"num_jobs": num_jobs, "num_events": num_events, "version": 4}
    found = json.loads(marker.read_text()) if marker.is_file() else None
    if found == params:
        return None
    start = time.perf_counter()
    if found in ({**params, "version": 2}, {**params, "version": 3}):  # the same events, stored earlier
        # Jobs end again: each summary stored as the supervisor stores it at job end (idempotent).
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_close, sorted(root.glob("job-*")), chunksize=8))
        atomic_write(marker, json.dumps(params))
        return time.perf_counter() - start
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("job-*/*"):
        stale.unlink()
    per_job = num_events // num_jobs
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_write, [(root, i, per_job) for i in range(num_jobs)], chunksize=8))
    atomic_write(marker, json.dumps(params))
    return time.perf_counter() - start


def _write_url(args: tuple[str, int, int]) -> int:
    url, i, per_job = args
    write_job_url(url, _spec(i, per_job), batch=200_000)
    return i


def generate_postgres(url: str, marker: Path, num_jobs: int, num_events: int, workers: int) -> float | None:
    """The same fleet in the PostgreSQL ledger at `url` (its server's data kept beside `marker`)."""
    params = {"num_jobs": num_jobs, "num_events": num_events, "version": 3}
    if marker.is_file() and json.loads(marker.read_text()) == params:
        return None
    import psycopg

    start = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS ettr CASCADE")
    per_job = num_events // num_jobs
    _write_url((url, 0, per_job))  # creates the schema, alone
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_write_url, [(url, i, per_job) for i in range(1, num_jobs)], chunksize=8))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE ettr.events")  # what autovacuum does to a table that stopped growing
    atomic_write(marker, json.dumps(params))
    return time.perf_counter() - start


def _fleet_cli(*source: str, flags: tuple[str, ...] = ()) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "ettr.cli", "fleet", *source, "--json", *flags]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"ettr fleet failed: {done.stderr[-2000:]}")
    return elapsed, json.loads(done.stdout)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _timed_fleet(source: tuple[str, ...], runs: int, from_events: bool) -> dict:
    """Median of `runs` first reads (no cache of an earlier run), and one `--from-events` read."""
    times, out = [], {}
    for _ in range(runs):
        elapsed, out = _fleet_cli(*source, flags=("--no-cache",))
        times.append(elapsed)
        _say(f"  ettr fleet {source[0][:40]} --json (first read): {elapsed:.2f} s")
    events_s, events_out = None, None
    if from_events:
        events_s, events_out = _fleet_cli(*source, flags=("--no-cache", "--from-events"))
        _say(f"  ettr fleet --json --from-events: {events_s:.2f} s")
    if events_out is not None and events_out["jobs"] != out["jobs"]:
        raise SystemExit("the stored summaries and the events disagree: a bug, not a benchmark result")
    return {"fleet_s": statistics.median(times), "fleet_runs_s": times, "out": out,
            "fleet_from_events_s": events_s, "same_as_from_events": None if events_out is None else True}  # fmt: skip


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


def _postgres(args: argparse.Namespace, per_job_events: int) -> dict | None:
    """The PostgreSQL half: the same fleet in a private server's ledger (kept under a temp dir)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' server launcher
    from pg_server import PostgresServer, PostgresUnavailable

    base = Path(args.pg_dir or Path(tempfile.gettempdir()) / f"ettr-fleet-bench-pg-{args.jobs}-{args.events}")
    try:
        server = PostgresServer(base, durable=True)
        server.start()
    except PostgresUnavailable as exc:
        _say(f"  no PostgreSQL server here ({exc}): the PostgreSQL half is not measured")
        return None
    try:
        generate_s = generate_postgres(
            server.url, base / "COMPLETE.json", args.jobs, args.events, os.cpu_count() or 1
        )
        _say("  PostgreSQL fleet " + (f"generated in {generate_s:.1f} s" if generate_s else "(cached)"))
        timed = _timed_fleet(("--ledger", server.url), args.runs, args.from_events)
        out = timed.pop("out")
        assert len(out["jobs"]) == args.jobs, len(out["jobs"])
        from ettr.fleet.serve import loader, start_server

        ns = argparse.Namespace(run_dirs=[], ledger=server.url, workers=None, no_cache=True)
        metrics = start_server(loader(ns), port=0, addr="127.0.0.1")
        try:
            cold, _ = _scrape(metrics.port)
            warm = statistics.median(_scrape(metrics.port)[0] for _ in range(3))
        finally:
            metrics.close()
        return {**timed, "scrape_cold_s": cold, "scrape_warm_s": warm, "generate_s": generate_s,
                "fleet_ett_pct": out["ett_pct"]}  # fmt: skip
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--events", type=int, default=1_000_000, help="total events over all jobs")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of ettr fleet (median)")
    parser.add_argument("--cache-dir", help="where the synthetic fleet is kept (default: a temp dir)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the one-worker run")
    parser.add_argument("--no-postgres", action="store_true", help="skip the PostgreSQL half")
    parser.add_argument(
        "--from-events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time one --from-events read (default: below 5M events; at 10M it takes minutes)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="a small fleet, generated afresh (CI's check that it runs)"
    )
    args = parser.parse_args()
    args.pg_dir = None
    if args.quick:
        args.jobs, args.events, args.runs = 20, 20_000, 1
        # Each its own directory in the temp dir: the PostgreSQL server may run as another user (under root),
        # which must reach its directory.
        args.cache_dir = tempfile.mkdtemp(prefix="ettr-fleet-quick-")
        args.pg_dir = tempfile.mkdtemp(prefix="ettr-fleet-quick-pg-")
        try:
            run(args)
        finally:
            shutil.rmtree(args.cache_dir, ignore_errors=True)
            shutil.rmtree(args.pg_dir, ignore_errors=True)
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    if args.from_events is None:
        args.from_events = args.events < 5_000_000
    workers = max(1, (os.cpu_count() or 1) // 2)  # what ettr fleet uses by default
    root = Path(args.cache_dir or Path(tempfile.gettempdir()) / f"ettr-fleet-bench-{args.jobs}-{args.events}")
    generate_s = generate(root, args.jobs, args.events, os.cpu_count() or 1)
    _say(f"fleet of {args.jobs} jobs / {args.events} events in {root}"
         + (f" (generated in {generate_s:.1f} s)" if generate_s else " (cached)"))  # fmt: skip

    num_events = count_events(root)
    timed = _timed_fleet((str(root),), args.runs, args.from_events)
    out = timed.pop("out")
    assert len(out["jobs"]) == args.jobs, len(out["jobs"])
    fleet_s = timed["fleet_s"]
    sequential = None
    if not args.no_sequential and workers > 1:
        sequential, _ = _fleet_cli(str(root), flags=("--no-cache", "--workers", "1"))
        _say(f"  ettr fleet --json --workers 1: {sequential:.2f} s")
    with tempfile.TemporaryDirectory() as cache:
        _fleet_cli(str(root), flags=("--cache-dir", cache))  # fills the cache of finished jobs
        warm_runs = [_fleet_cli(str(root), flags=("--cache-dir", cache))[0] for _ in range(args.runs)]
    _say(f"  ettr fleet --json (finished jobs cached): {statistics.median(warm_runs):.2f} s")

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
    postgres = None if args.no_postgres else _postgres(args, args.events // args.jobs)
    big = args.events >= 10_000_000
    result = {
        "num_jobs": args.jobs,
        "num_events": num_events,
        "write_path": WRITE_PATH,
        "workers": workers,
        **timed,
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
        "postgres": postgres,
        "goal_10m_events_under_10s": (fleet_s < 10.0) if big else None,
        "goal_10m_events_under_10s_postgres": (
            (postgres["fleet_s"] < 10.0) if big and postgres is not None else None
        ),
        "quick": args.quick,
    }
    _say(
        f"ettr fleet over {args.jobs} jobs / {num_events} events: run dirs {fleet_s:.2f} s median "
        f"({workers} workers"
        + (f"; 1 worker {sequential:.2f} s" if sequential else "")
        + (f"; --from-events {timed['fleet_from_events_s']:.2f} s" if timed["fleet_from_events_s"] else "")
        + (f"), PostgreSQL {postgres['fleet_s']:.2f} s" if postgres else "), PostgreSQL not measured")
        + f"; /metrics {cold:.2f} s cold, {statistics.median(warm) * 1000:.0f} ms warm, {num_series} series"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

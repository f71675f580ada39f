"""The shared ledger at scale: PostgreSQL beside SQLite, measured in one run on the same machine.

1. append rate: events/s stored by `--writers` (16) concurrent writer processes, each appending batches of
   `--batch` events as a Recorder's writer thread does, to one job in PostgreSQL and in one SQLite file;
2. `ettr report --json` (the whole command, start-up included) for one job of `--report-events` (1M)
   events, read from PostgreSQL (`--ledger URL --job-id`) and from a run directory's SQLite;
3. the training thread's cost per event (`Recorder.step`) with either ledger (and an in-memory one, the floor)
   behind the Recorder: at `--outage-rate` events/s as a training loop makes them, and 100k back to back
   (the writer thread then competes for the GIL all the time: a stress figure, noisy on a loaded machine);
4. the spill path: a Recorder writing `--outage-rate` events/s through `SpillingLedger` while the server is
   stopped for `--outage-s` (30) seconds; the catch-up time is from the server's restart until every
   spilled event is on it, checked exactly once each.

PostgreSQL is a throwaway local server with durable commits (fsync on), or `--postgres-url` for an existing
one (the outage part then is skipped: it needs to stop the server). `--json` ends with one JSON object.
`--quick` (what CI runs): 2 writers of 2 batches of 200 events, a report of 20,000 events, 1.5 s of paced
events and bursts of 10,000 per ledger, a 2 s outage. Without PostgreSQL binaries the benchmark says so in
one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ettr.events import Event, EventKind
from ettr.ledger import MemoryLedger, open_ledger
from ettr.ledger.postgres import PostgresLedger
from ettr.ledger.spill import SpillingLedger, read_spill, spill_dir
from ettr.recorder import Recorder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recorder_overhead import synthetic_job  # noqa: E402  (the same 1M-event job the other benchmark uses)

RETRY_INTERVAL_S = 2.0  # SpillingLedger's default: how often the server is tried during an outage


# -- 1. concurrent writers -------------------------------------------------------------------------------
def _writer(target: str, kind: str, rank: int, num_batches: int, batch: int, go, done) -> None:  # type: ignore[no-untyped-def]
    ledger = PostgresLedger(target, job_id="append") if kind == "postgres" else open_ledger(target)
    batches = [
        [Event(EventKind.STEP, 1e9 + i * batch + j, 0, rank, step=i * batch + j) for j in range(batch)]
        for i in range(num_batches)
    ]
    done.put(("ready", rank, 0.0))
    go.wait()
    for events in batches:
        ledger.append(events)
    done.put(("done", rank, time.time()))
    ledger.close()


def append_rate(target: str, kind: str, *, num_writers: int, num_batches: int, batch: int) -> float:
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(target, kind, r, num_batches, batch, go, done))
        for r in range(num_writers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        assert done.get(timeout=300)[0] == "ready"
    start = time.time()
    go.set()
    ends = [done.get(timeout=600)[2] for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"{kind} writer failed"
    return num_writers * num_batches * batch / (max(ends) - start)


# -- 2. the report of a 1M-event job ---------------------------------------------------------------------
def report_s(argv: list[str], runs: int) -> float:
    costs = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    for _ in range(runs):
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "ettr.cli", "report", *argv, "--json"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        costs.append(time.perf_counter() - t0)
        assert done.returncode == 0, done.stderr
    return statistics.median(costs)


# -- 3. the training thread's cost -------------------------------------------------------------------------
def event_cost_us(ledgers: dict[str, object], *, rate: int, seconds: float, burst: int) -> dict[str, float]:
    """Median cost of `Recorder.step` per event with each ledger behind the Recorder, the ledgers taking turns
    (so that the load of a shared machine hits them alike), the writer thread draining meanwhile.

    `name`: at `rate` events/s (bursts of rate/10 events, then 0.1 s of "compute"): a training loop's cost.
    `name_burst`: `burst` events back to back, so the writer thread competes for the GIL the whole time.
    """
    recorders = {name: Recorder(ledger, flush_interval_s=0.5) for name, ledger in ledgers.items()}  # type: ignore[arg-type]
    paced: dict[str, list[float]] = {name: [] for name in ledgers}
    bursts: dict[str, list[float]] = {name: [] for name in ledgers}
    per_burst = max(1, rate // 10)
    for _ in range(3):
        for name, rec in recorders.items():
            end = time.monotonic() + seconds / 3
            while time.monotonic() < end:
                t0 = time.perf_counter()
                for i in range(per_burst):
                    rec.step(i)
                paced[name].append((time.perf_counter() - t0) / per_burst * 1e6)
                time.sleep(0.1)
            t0 = time.perf_counter()
            for i in range(burst):
                rec.step(i)
            bursts[name].append((time.perf_counter() - t0) / burst * 1e6)
            rec.flush(timeout_s=60)
    for rec in recorders.values():
        rec.close()
    result = {name: statistics.median(values) for name, values in paced.items()}
    result.update({f"{name}_burst": statistics.median(values) for name, values in bursts.items()})
    return result


# -- 4. the spill path -----------------------------------------------------------------------------------
def outage(server, work: Path, *, outage_s: float, rate: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    url = server.url
    run_dir = work / "outage-run"
    run_dir.mkdir()

    def connect() -> PostgresLedger:
        return PostgresLedger(url, job_id="outage", create=True, run_dir=run_dir)

    ledger = SpillingLedger(
        connect,
        job_id="outage",
        spill_dir=spill_dir(run_dir),
        node="bench",
        retry_interval_s=RETRY_INTERVAL_S,
    )
    rec = Recorder(ledger, flush_interval_s=0.5)
    step = 0
    costs: list[float] = []

    def train_for(seconds: float) -> None:
        nonlocal step
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            for _ in range(rate // 10):
                step += 1
                rec.step(step)
            costs.append((time.perf_counter() - t0) / (rate // 10) * 1e6)
            time.sleep(0.1)

    train_for(2.0)
    server.stop()
    train_for(outage_s)
    files = list(spill_dir(run_dir).glob("*.jsonl"))
    spilled_bytes = sum(p.stat().st_size for p in files)
    spilled_events = sum(len(read_spill(p)[1]) for p in files)
    server.start()
    restarted = time.monotonic()
    while True:  # training goes on; the catch-up ends when nothing is left in the spill file
        train_for(0.2)
        rec.flush(timeout_s=60)
        if not ledger.backlog and not ledger.server_down:
            break
        assert time.monotonic() - restarted < 600, "the spill was not delivered in 10 minutes"
    catch_up_s = time.monotonic() - restarted
    rec.close()
    ledger.close()
    stored = PostgresLedger(url, job_id="outage").read()
    steps = [e.step for e in stored if e.kind is EventKind.STEP]
    assert sorted(steps) == list(range(1, step + 1)), "events lost or stored twice"
    return {
        "outage_s": outage_s,
        "catch_up_s": catch_up_s,
        "spilled_events": float(spilled_events),
        "spill_bytes": float(spilled_bytes),
        "retry_interval_s": RETRY_INTERVAL_S,
        "event_cost_during_outage_us": statistics.median(costs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--batches", type=int, default=20, help="batches per writer")
    parser.add_argument("--batch", type=int, default=1000, help="events per batch")
    parser.add_argument("--report-events", type=int, default=1_000_000)
    parser.add_argument("--report-runs", type=int, default=3)
    parser.add_argument("--outage-s", type=float, default=30.0)
    parser.add_argument(
        "--outage-rate", type=int, default=2000, help="events/s of the training loop (cost and outage parts)"
    )
    parser.add_argument("--postgres-url", help="an existing server to measure (no outage part)")
    parser.add_argument(
        "--quick", action="store_true", help="a small run of every part (CI's check that it runs)"
    )
    args = parser.parse_args()
    cost_s, burst = 6.0, 100_000
    if args.quick:
        args.writers, args.batches, args.batch, args.report_events, args.report_runs = 2, 2, 200, 20_000, 1
        args.outage_s, args.outage_rate, cost_s, burst = 2.0, 500, 1.5, 10_000

    server = None
    if args.postgres_url:
        url = args.postgres_url
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' server launcher
        from pg_server import PostgresServer, PostgresUnavailable

        try:
            server = PostgresServer(durable=True)
            server.start()
        except PostgresUnavailable as exc:
            print(f"ledger_scale.py: no PostgreSQL server can be started here ({exc})", file=sys.stderr)
            if server is not None:
                server.remove()
            return 2
        url = server.url
    result: dict[str, object] = {"writers": args.writers, "batch": args.batch, "quick": args.quick}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            PostgresLedger(url, job_id="append", create=True).close()
            kwargs = {"num_writers": args.writers, "num_batches": args.batches, "batch": args.batch}
            result["append_events_per_s_postgres"] = append_rate(url, "postgres", **kwargs)
            result["append_events_per_s_sqlite"] = append_rate(str(work / "append"), "sqlite", **kwargs)
            print(
                f"{args.writers} writers: PostgreSQL {result['append_events_per_s_postgres']:,.0f} events/s, "
                f"SQLite {result['append_events_per_s_sqlite']:,.0f} events/s"
            )

            events = synthetic_job(args.report_events)
            job_id = f"report-{len(events)}"
            pg = PostgresLedger(url, job_id=job_id, create=True)
            sqlite = open_ledger(work / "report")
            for i in range(0, len(events), 50_000):
                pg.append(events[i : i + 50_000])
                sqlite.append(events[i : i + 50_000])
            pg.close()
            sqlite.close()
            runs = args.report_runs
            result["report_events"] = len(events)
            result["report_s_postgres"] = report_s(["--ledger", url, "--job-id", job_id], runs)
            result["report_s_sqlite"] = report_s([str(work / "report")], runs)
            print(
                f"ettr report of {len(events):,} events: PostgreSQL {result['report_s_postgres']:.2f} s, "
                f"SQLite {result['report_s_sqlite']:.2f} s"
            )

            def spilling() -> SpillingLedger:
                return SpillingLedger(
                    lambda: PostgresLedger(url, job_id="cost", create=True),
                    job_id="cost",
                    spill_dir=spill_dir(work / "cost-run"),
                    node="bench",
                )

            ledgers = {"postgres": spilling(), "sqlite": open_ledger(work / "cost"), "memory": MemoryLedger()}
            cost = event_cost_us(ledgers, rate=args.outage_rate, seconds=cost_s, burst=burst)
            for name in ("postgres", "sqlite", "memory"):  # memory: the Recorder alone, the floor here
                result[f"event_cost_us_{name}"] = cost[name]
                result[f"event_cost_burst_us_{name}"] = cost[f"{name}_burst"]
            print(
                f"training-thread cost per event at {args.outage_rate} events/s: PostgreSQL "
                f"{cost['postgres']:.2f} us, SQLite {cost['sqlite']:.2f} us, in-memory {cost['memory']:.2f} us; "
                f"100k back to back: {cost['postgres_burst']:.2f} / {cost['sqlite_burst']:.2f} / "
                f"{cost['memory_burst']:.2f} us"
            )
            if server is not None:
                found = outage(server, work, outage_s=args.outage_s, rate=args.outage_rate)
                result.update({f"spill_{k}": v for k, v in found.items()})
                print(
                    f"spill: {found['outage_s']:g} s outage at {args.outage_rate} events/s -> "
                    f"{found['spilled_events']:,.0f} events ({found['spill_bytes'] / 1e6:.1f} MB) spilled; caught up {found['catch_up_s']:.2f} s after "
                    f"the server returned; {found['event_cost_during_outage_us']:.2f} us/event meanwhile; "
                    "every event stored once"
                )
    finally:
        if server is not None:
            server.remove()
    if args.json:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

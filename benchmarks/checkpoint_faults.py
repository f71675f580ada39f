"""SIGKILL trials against ettr's checkpointing: does a resume ever load an incomplete or corrupt checkpoint?

Each trial runs the deterministic toy job (`ettr.testing.toyjob`, saving after every step so that a
persist is almost always in flight) in a real process, kills it with SIGKILL, and restores its checkpoint
root as the next attempt would (`ettr.testing.faults.TrialRunner`). Kinds of trial:
    random    SIGKILL at a uniformly random moment of the run (thread-mode persist)
    point     SIGKILL inside the persist at a named point: after the data files, after DCP's metadata,
              before the manifest, halfway through writing it, right after its rename
    process   SIGKILL at a random moment with the persist in DCP's checkpoint process (which must not
              commit after its trainer died)
    disk_full the toy job on a real tmpfs (mounted by the benchmark when it runs as root; otherwise these
              trials are skipped and the output says so) holding fewer checkpoints than keep_last:
              saves must make room first, or fail loudly (ENOSPC recorded, the final save raising)
    eio       a resume through storage whose next 1-3 reads raise EIO (`ettr.testing.disk_faults.
              FlakyStorage`): retried, the newest checkpoint loaded, nothing quarantined
A resume is bad if restoring raises or the restored state differs bit-wise from the state an uninterrupted
run had at that step; stale if it is older than the newest commit the ledger recorded. Resumes read the
rank's memory copy of the newest commit where one checks out (`ettr.checkpoint.memory`: a kill between a
commit and its memory copy leaves a stale copy, which must not be used), storage otherwise; the output
counts both.

    python benchmarks/checkpoint_faults.py [--trials 100] [--process-trials 6] [--disk-trials 6]
        [--eio-trials 10] [--seed 0] [--json]

`--json` ends with one object: trials, bad_resumes, stale_resumes, and counts by kind and outcome. `--quick`
(what CI runs): 6 thread-mode trials (one at each persist point, one random), 1 process-mode, 1 disk-full and
2 EIO trials. Exit status 1 when a resume was bad or stale.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import tempfile
import time
import warnings

from ettr.checkpoint.writer import FAULT_POINTS
from ettr.testing import disk_faults
from ettr.testing.faults import TrialResult, TrialRunner
from ettr.testing.toyjob import ToyJob, reference_digests


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run_kind(runner: TrialRunner, kind: str, count: int, first_index: int) -> list[TrialResult]:
    results = []
    for i in range(count):
        if kind == "point":
            result = runner.run_trial(
                first_index + i, point=FAULT_POINTS[i % len(FAULT_POINTS)], nth_save=2 + i % 3
            )
        else:
            result = runner.run_trial(first_index + i)
        results.append(result)
        if result.bad or result.stale:
            _say(f"  trial {result.index} ({result.kill}): BAD: {result.detail}")
    return results


def _disk_trials(num_disk: int, num_eio: int, seed: int) -> dict[str, object]:
    """Disk-full trials on a tmpfs (root only) and transient-EIO resume trials, in this process."""
    import random

    rng = random.Random(seed)
    hidden, num_steps = 128, 8
    reference = reference_digests(ToyJob(root="-", hidden=hidden, num_steps=num_steps))
    out: dict[str, object] = {}
    kinds: dict[str, list[disk_faults.DiskTrialResult]] = {"disk_full": [], "eio": []}
    if num_disk and disk_faults.can_mount_tmpfs():
        size = disk_faults.checkpoint_bytes(hidden=hidden)
        _say(f"disk-full: a checkpoint is {size} bytes; tmpfs of 0.6-3.5 checkpoints, keep_last=4")
        for _ in range(num_disk):
            fits = rng.uniform(0.6, 3.5)
            kinds["disk_full"].append(
                disk_faults.disk_full_trial(
                    size_bytes=int(size * fits),
                    hidden=hidden,
                    num_steps=num_steps,
                    keep_last=4,
                    reference=reference,
                )
            )
    elif num_disk:
        out["disk_full"] = "skipped: mounting a tmpfs needs root (no fake disk-full storage is used)"
    for i in range(num_eio):
        kinds["eio"].append(
            disk_faults.eio_trial(
                fail_reads=1 + i % 3, hidden=hidden, num_steps=num_steps, reference=reference
            )
        )
    for kind, rs in kinds.items():
        if kind in out or not rs:
            continue
        for r in rs:
            if r.bad or r.stale or not r.loud:
                _say(f"  {kind}: BAD: {r}")
        out[kind] = {
            "trials": len(rs),
            "finished": sum(r.finished for r in rs),
            "errors": sum(r.num_errors for r in rs) if kind == "disk_full" else 0,
            "eio_injected": sum(r.num_errors for r in rs) if kind == "eio" else 0,
            "all_loud": all(r.loud for r in rs),
            "bad_resumes": sum(r.bad for r in rs),
            "stale_resumes": sum(r.stale for r in rs),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trials", type=int, default=100, help="thread-mode trials, random and point (default 100)"
    )
    parser.add_argument("--process-trials", type=int, default=6, help="process-mode trials (default 6)")
    parser.add_argument("--disk-trials", type=int, default=6, help="disk-full trials on a tmpfs (default 6)")
    parser.add_argument("--eio-trials", type=int, default=10, help="transient-EIO resume trials (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--dir", help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="a few trials of each kind (CI's check that it runs)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.process_trials, args.disk_trials, args.eio_trials = len(FAULT_POINTS) + 1, 1, 1, 2
    if args.trials < 1 or args.process_trials < 0:
        parser.error("--trials must be >= 1 and --process-trials >= 0")
    warnings.filterwarnings("ignore")
    logging.getLogger("ettr").setLevel(logging.ERROR)  # every resume after a mid-persist kill warns; expected
    begin = time.monotonic()
    num_point = max(len(FAULT_POINTS), args.trials // 4)
    num_random = args.trials - num_point
    results: dict[str, list[TrialResult]] = {}
    with tempfile.TemporaryDirectory(prefix="ettr-faults-", dir=args.dir) as workdir:
        os.environ["ETTR_MEMORY_DIR"] = f"{workdir}/memory"  # the killed jobs' memory copies go with it
        runner = TrialRunner(f"{workdir}/thread", seed=args.seed)
        _say(f"thread mode: a run trains and persists for {runner.calibrate():.2f} s after start-up")
        results["random"] = _run_kind(runner, "random", num_random, 0)
        _say(f"random: {len(results['random'])} trials done ({time.monotonic() - begin:.0f} s)")
        results["point"] = _run_kind(runner, "point", num_point, 10_000)
        _say(f"point: {len(results['point'])} trials done ({time.monotonic() - begin:.0f} s)")
        if args.process_trials:
            # a larger state: persists long enough next to the hand-over to the checkpoint process
            process_runner = TrialRunner(
                f"{workdir}/process", mode="process", hidden=1024, num_steps=40, seed=args.seed + 1
            )
            _say(
                f"process mode: a run trains and persists for {process_runner.calibrate():.2f} s after start-up"
            )
            results["process"] = _run_kind(process_runner, "process", args.process_trials, 20_000)
    disk = _disk_trials(args.disk_trials, args.eio_trials, args.seed)
    everything = [r for kind in results.values() for r in kind]
    summary = {
        "trials": len(everything),
        "bad_resumes": sum(r.bad for r in everything),
        "stale_resumes": sum(r.stale for r in everything),
        "killed": sum(r.exit_code == -9 for r in everything),
        "killed_mid_persist": sum(r.exit_code == -9 and r.num_incomplete > 0 for r in everything),
        "finished_before_the_kill": sum(r.exit_code == 0 for r in everything),
        "resumed_from_scratch": sum(r.resumed_step is None for r in everything),
        "resumed_from_memory": sum(r.restored_from == "memory" for r in everything),
        "resumed_from_storage": sum(r.restored_from == "storage" for r in everything),
        "by_kind": {
            kind: {
                "trials": len(rs),
                "bad_resumes": sum(r.bad for r in rs),
                "stale_resumes": sum(r.stale for r in rs),
                "killed_mid_persist": sum(r.exit_code == -9 and r.num_incomplete > 0 for r in rs),
            }
            for kind, rs in results.items()
        },
        "by_point": dict(collections.Counter(r.kill for r in results.get("point", []))),
        "disk": disk,
        "wall_s": time.monotonic() - begin,
        "quick": args.quick,
    }
    summary["bad_resumes"] += sum(d["bad_resumes"] for d in disk.values() if isinstance(d, dict))
    summary["stale_resumes"] += sum(d["stale_resumes"] for d in disk.values() if isinstance(d, dict))
    print(f"{summary['trials']} SIGKILL trials in {summary['wall_s']:.0f} s")
    for kind, counts in summary["by_kind"].items():
        print(
            f"  {kind:8s} {counts['trials']:4d} trials, {counts['killed_mid_persist']:4d} killed mid-persist, "
            f"{counts['bad_resumes']} bad resumes, {counts['stale_resumes']} stale"
        )
    print(f"  killed: {summary['killed']}, of them mid-persist: {summary['killed_mid_persist']}")
    print(f"  finished before the kill: {summary['finished_before_the_kill']}")
    print(
        f"  resumed from memory: {summary['resumed_from_memory']}, from storage: "
        f"{summary['resumed_from_storage']}, from scratch: {summary['resumed_from_scratch']}"
    )
    for kind, d in disk.items():
        if isinstance(d, dict):
            print(
                f"  {kind:9s} {d['trials']:3d} trials, {d['finished']} finished, {d['errors']} save errors "
                f"(all loud: {d['all_loud']}), {d['eio_injected']} EIO injected, {d['bad_resumes']} bad resumes, {d['stale_resumes']} stale"
            )
        else:
            print(f"  {kind:9s} {d}")
    print(f"bad resumes (incomplete or corrupt checkpoint loaded): {summary['bad_resumes']}")
    print(f"stale resumes (older than a recorded commit): {summary['stale_resumes']}")
    if args.json:
        print(json.dumps(summary))
    return 1 if summary["bad_resumes"] or summary["stale_resumes"] else 0


if __name__ == "__main__":
    sys.exit(main())

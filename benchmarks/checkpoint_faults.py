"""SIGKILL trials against ettr's checkpointing: does a resume ever load an incomplete or corrupt checkpoint?

Each trial runs the deterministic toy job (`ettr.testing.toyjob`, saving after every step so that a
persist is almost always in flight) in a real process, kills it with SIGKILL, and restores its checkpoint
root as the next attempt would (`ettr.testing.faults.TrialRunner`). Kinds of trial:
    random    SIGKILL at a uniformly random moment of the run (thread-mode persist)
    point     SIGKILL inside the persist at a named point: after the data files, after DCP's metadata,
              before the manifest, halfway through writing it, right after its rename
    process   SIGKILL at a random moment with the persist in DCP's checkpoint process (which must not
              commit after its trainer died)
A resume is bad if restoring raises or the restored state differs bit-wise from the state an uninterrupted
run had at that step; stale if it is older than the newest commit the ledger recorded.

    python benchmarks/checkpoint_faults.py [--trials 100] [--process-trials 6] [--seed 0] [--json]

`--json` ends with one object: trials, bad_resumes, stale_resumes, and counts by kind and outcome.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import tempfile
import time
import warnings

from ettr.checkpoint.writer import FAULT_POINTS
from ettr.testing.faults import TrialResult, TrialRunner


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trials", type=int, default=100, help="thread-mode trials, random and point (default 100)"
    )
    parser.add_argument("--process-trials", type=int, default=6, help="process-mode trials (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--dir", help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.process_trials < 0:
        parser.error("--trials must be >= 1 and --process-trials >= 0")
    warnings.filterwarnings("ignore")
    logging.getLogger("ettr").setLevel(logging.ERROR)  # every resume after a mid-persist kill warns; expected
    begin = time.monotonic()
    num_point = max(len(FAULT_POINTS), args.trials // 4)
    num_random = args.trials - num_point
    results: dict[str, list[TrialResult]] = {}
    with tempfile.TemporaryDirectory(prefix="ettr-faults-", dir=args.dir) as workdir:
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
    everything = [r for kind in results.values() for r in kind]
    summary = {
        "trials": len(everything),
        "bad_resumes": sum(r.bad for r in everything),
        "stale_resumes": sum(r.stale for r in everything),
        "killed": sum(r.exit_code == -9 for r in everything),
        "killed_mid_persist": sum(r.exit_code == -9 and r.num_incomplete > 0 for r in everything),
        "finished_before_the_kill": sum(r.exit_code == 0 for r in everything),
        "resumed_from_scratch": sum(r.resumed_step is None for r in everything),
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
        "wall_s": time.monotonic() - begin,
    }
    print(f"{summary['trials']} SIGKILL trials in {summary['wall_s']:.0f} s")
    for kind, counts in summary["by_kind"].items():
        print(
            f"  {kind:8s} {counts['trials']:4d} trials, {counts['killed_mid_persist']:4d} killed mid-persist, "
            f"{counts['bad_resumes']} bad resumes, {counts['stale_resumes']} stale"
        )
    print(f"  killed: {summary['killed']}, of them mid-persist: {summary['killed_mid_persist']}")
    print(f"  finished before the kill: {summary['finished_before_the_kill']}")
    print(f"bad resumes (incomplete or corrupt checkpoint loaded): {summary['bad_resumes']}")
    print(f"stale resumes (older than a recorded commit): {summary['stale_resumes']}")
    if args.json:
        print(json.dumps(summary))
    return 1 if summary["bad_resumes"] or summary["stale_resumes"] else 0


if __name__ == "__main__":
    sys.exit(main())

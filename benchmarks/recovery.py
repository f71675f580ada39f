"""Time to recover a 2-rank job: plain torchrun, ettr's process restart (from storage, from memory) and ettr's
restart in place, interleaved, after a crash and a SIGKILL.

The job (`ettr.testing.resilient_job`: 2-rank gloo DDP, ettr's CheckpointManager, a checkpoint every 10 steps,
35 steps) fails once on rank 1 after step 25: `crash` raises an exception, `kill` SIGKILLs the rank. Launchers:
    torchrun      `torchrun --max-restarts 1`, the job without memory copies (restores from storage)
    ettr          `ettr run --max-restarts 1 -- torchrun ...`, no memory copies: ettr's process restart
    ettr_memory   the same with memory copies: the restarted ranks restore from memory
    ettr_inplace  the job under `ettr.resilient`; run by `torchrun --max-restarts 1` until ettr's agent restarts
                  in place (docs/inplace.md): a crash is restarted in place among the same processes, a killed
                  rank is not replaced, so its peer gives up after `--rendezvous-timeout-s` and torchrun
                  restarts both (from memory)
A recovery succeeded when the command exited 0, trained to the last step after the fault, and both ranks end
with the parameters of an uninterrupted run (`bad_resumes` counts the others). TTR is measured the same way
for all, from the job's own timestamps: the fault to the first step completed after the post-fault restore,
split into `detect_relaunch_s` (fault -> the generation or process that recovers starts training: detection,
teardown, relaunch, imports, rendezvous), `build_restore_s` (model, checkpoint manager and restore) and
`first_step_s`. For the ettr launchers the ledger's parts (`EttReport.ttr_parts`) are given too.

Then `--kill-trials` SIGKILL trials of restart in place (`ettr.testing.inplace_faults`): the job restarts in
place after a raise on rank 1, and a random rank is SIGKILLed at a random moment, half of them aimed at that
recovery; a launcher of the harness's own restarts both ranks after a death. Each trial must end with the
parameters of an uninterrupted run.

    python benchmarks/recovery.py [--trials 10] [--faults crash,kill] [--launchers ...] [--hidden 512]
        [--kill-trials 100] [--json]

`--quick` (what CI runs): one crash trial of each launcher with a small model, 2 kill trials.

`--json` ends with one object: `faults.<fault>.<launcher>`: trials, recovered, bad_resumes, median and worst TTR
(s), each trial's TTR, parts_median_s (the log's parts, and for ettr the ledger's), restored_from (counts);
`kill_trials`: trials, completed, bad_resumes, landed (counts: before_raise, recovery, after_recovery,
not_fired), process_restarts, restored_from; `bad_resumes`: of everything.
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
from pathlib import Path
from typing import Any

LAUNCHERS = ("torchrun", "ettr", "ettr_memory", "ettr_inplace")
FAULTS = {"crash": "raise", "kill": "kill"}
NUM_STEPS, EVERY, FAIL_AT = 35, 10, 25


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _torchrun(max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts)]  # fmt: skip


def _job(work: Path, launcher: str, fault: str, args: argparse.Namespace) -> list[str]:
    job = [
        "-m", "ettr.testing.resilient_job", "--ckpt-dir", str(work / "ckpt"), "--timings", str(work / "log.jsonl"),
        "--steps", str(NUM_STEPS), "--every", str(EVERY), "--fail-at", str(FAIL_AT), "--fail-rank", "1",
        "--fault", fault, "--hidden", str(args.hidden), "--step-s", f"{args.step_s:g}",
        "--rendezvous-timeout-s", f"{args.rendezvous_timeout_s:g}",
    ]  # fmt: skip
    if launcher != "ettr_inplace":
        job.append("--no-resilient")
    if launcher in ("torchrun", "ettr"):
        job.append("--no-memory-copy")
    return job


def _command(launcher: str, work: Path, fault: str, args: argparse.Namespace) -> list[str]:
    job = _job(work, launcher, fault, args)
    if launcher in ("torchrun", "ettr_inplace"):
        return [*_torchrun(1), *job]
    ettr = [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(work / "run"), "--max-restarts", "1"]
    return [*ettr, "--", *_torchrun(0), *job]


def _measure(log: Path) -> dict[str, Any]:
    """From the job's log: trained to the end after the fault, TTR and its parts, where the restore read,
    and the final digests."""
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    fault = next((e for e in lines if e["ev"] == "fault"), None)
    out: dict[str, Any] = {"done": False, "ttr_s": None, "parts_s": {}, "restored_from": None, "digests": []}
    out["digests"] = sorted({e["digest"] for e in lines if e["ev"] == "done"})
    if fault is None:
        return out
    after = [e for e in lines if e["ts"] > fault["ts"]]
    restored = [e for e in after if e["ev"] == "restored"]
    if not restored:
        return out
    last_restore = max(restored, key=lambda e: e["ts"])
    steps = [e for e in after if e["ev"] == "step" and e["ts"] > last_restore["ts"]]
    trains = [e for e in after if e["ev"] == "train" and e["ts"] <= last_restore["ts"]]
    out["done"] = any(e["step"] == NUM_STEPS for e in steps)
    out["restored_from"] = last_restore.get("source") or "nothing"
    if steps and trains:
        first_step = min(e["ts"] for e in steps)
        train = max(e["ts"] for e in trains)  # the later of the two ranks starting the recovering generation
        out["ttr_s"] = first_step - fault["ts"]
        out["parts_s"] = {
            "detect_relaunch_s": train - fault["ts"],
            "build_restore_s": last_restore["ts"] - train,
            "first_step_s": first_step - last_restore["ts"],
        }
    return out


def _ledger_parts(run_dir: Path) -> dict[str, float]:
    from ettr.report.load import read_run

    try:
        _, report = read_run(run_dir)
    except Exception as exc:
        _say(f"  cannot read {run_dir}: {exc}")
        return {}
    if not report.ttr_parts:
        return {}
    parts = {f"ledger_{k}": v for k, v in report.ttr_parts[0].parts_s.items() if v is not None}
    parts["ledger_total_s"] = report.ttr_parts[0].total_s
    return parts


def _trial(launcher: str, fault: str, args: argparse.Namespace, reference: str | None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ettr-recovery-{launcher}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(work / "memory"))
    started = time.monotonic()
    try:
        proc = subprocess.run(
            _command(launcher, work, FAULTS.get(fault, fault), args),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=args.timeout_s,
            check=False,
        )
        rc: int | None = proc.returncode
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        rc, tail = None, [f"timed out after {args.timeout_s:g} s"]
    found = _measure(work / "log.jsonl")
    bad = reference is not None and bool(found["digests"]) and found["digests"] != [reference]
    result = {
        "rc": rc,
        "recovered": rc == 0 and found["done"] and not bad,
        "bad_resume": bad,
        "ttr_s": found["ttr_s"],
        "parts_s": found["parts_s"],
        "restored_from": found["restored_from"],
        "wall_s": time.monotonic() - started,
    }
    if launcher.startswith("ettr") and (work / "run").exists():
        result["parts_s"] = {**found["parts_s"], **_ledger_parts(work / "run")}
    if not result["recovered"]:
        result["why"] = "final state differs from the uninterrupted run" if bad else (tail[0] if tail else "")
    shutil.rmtree(work, ignore_errors=True)
    return result


def _reference(args: argparse.Namespace) -> str | None:
    """The final digest of an uninterrupted run of the same job."""
    work = Path(tempfile.mkdtemp(prefix="ettr-recovery-reference-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(work / "memory"))
    try:
        subprocess.run(
            [*_torchrun(0), *_job(work, "torchrun", "none", args)], env=env, capture_output=True,
            timeout=args.timeout_s, check=False,
        )  # fmt: skip
        digests = _measure(work / "log.jsonl")["digests"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return digests[0] if len(digests) == 1 else None


def _kill_trials(count: int) -> dict[str, Any]:
    from ettr.testing.inplace_faults import InPlaceTrialRunner

    with tempfile.TemporaryDirectory(prefix="ettr-inplace-kills-") as workdir:
        runner = InPlaceTrialRunner(workdir, seed=count)
        _say(f"kill trials: the job trains {runner.calibrate():.2f} s with its raise and no kill")
        trials = []
        for i in range(count):
            t = runner.run_trial(i, during_recovery=i % 2 == 0)
            trials.append(t)
            if t.bad or not t.completed:
                _say(f"  kill trial {i}: {t}")
            if (i + 1) % 10 == 0:
                _say(f"  {i + 1} kill trials done")
    landed: dict[str, int] = {}
    sources: dict[str, int] = {}
    for t in trials:
        landed[t.kill_landed] = landed.get(t.kill_landed, 0) + 1
        for source in t.restored_from:
            sources[source] = sources.get(source, 0) + 1
    return {
        "trials": len(trials),
        "completed": sum(t.completed for t in trials),
        "bad_resumes": sum(t.bad for t in trials),
        "landed": landed,
        "process_restarts": sum(t.launches - 1 for t in trials),
        "restored_from": sources,
    }


def _summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    ttrs = [t["ttr_s"] for t in trials if t["recovered"] and t["ttr_s"] is not None]
    out: dict[str, Any] = {
        "trials": len(trials),
        "recovered": sum(1 for t in trials if t["recovered"]),
        "bad_resumes": sum(1 for t in trials if t["bad_resume"]),
        "median_ttr_s": statistics.median(ttrs) if ttrs else None,
        "worst_ttr_s": max(ttrs) if ttrs else None,
        "ttr_s": [None if t["ttr_s"] is None else round(t["ttr_s"], 3) for t in trials],
        "restored_from": {},
    }
    for t in trials:
        source = t["restored_from"] or "none"
        out["restored_from"][source] = out["restored_from"].get(source, 0) + 1
    parts = [t["parts_s"] for t in trials if t["recovered"] and t["parts_s"]]
    if parts:
        names = list(dict.fromkeys(n for p in parts for n in p))
        out["parts_median_s"] = {
            n: round(statistics.median(vs), 3) for n in names if (vs := [p[n] for p in parts if n in p])
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10, help="trials per launcher and fault")
    parser.add_argument("--faults", default="crash,kill", help="comma-separated: crash, kill")
    parser.add_argument(
        "--launchers", default=",".join(LAUNCHERS), help="comma-separated: " + ", ".join(LAUNCHERS)
    )
    parser.add_argument(
        "--hidden", type=int, default=512, help="the model's width (state ~ 3 x 17 x hidden floats)"
    )
    parser.add_argument("--step-s", type=float, default=0.02, help="sleep per step")
    parser.add_argument(
        "--rendezvous-timeout-s", type=float, default=5.0, help="ettr_inplace: a dead rank's wait"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a trial still running then failed")
    parser.add_argument("--kill-trials", type=int, default=100, help="in-place SIGKILL trials (0: none)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="one crash trial per launcher, a small model (CI)"
    )
    args = parser.parse_args()
    if args.quick:
        args.trials, args.faults, args.hidden, args.kill_trials = 1, "crash", 64, 2
    faults = [f for f in args.faults.split(",") if f]
    launchers = [name for name in args.launchers.split(",") if name]
    bad = [f for f in faults if f not in FAULTS] + [name for name in launchers if name not in LAUNCHERS]
    if bad or args.trials < 1 or args.hidden < 1:
        print(f"recovery.py: bad --faults/--launchers {bad}, or --trials/--hidden below 1", file=sys.stderr)
        return 2
    reference = _reference(args)
    if reference is None:
        _say("the uninterrupted reference run failed: final states are not compared")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        f: {name: [] for name in launchers} for f in faults
    }
    for i in range(args.trials):
        for fault in faults:
            order = launchers[i % len(launchers) :] + launchers[: i % len(launchers)]  # interleaved, rotated
            for launcher in order:
                r = _trial(launcher, fault, args, reference)
                results[fault][launcher].append(r)
                ttr = "-" if r["ttr_s"] is None else f"{r['ttr_s']:.3f} s"
                why = "" if r["recovered"] else f" ({r.get('why', '')[:100]})"
                _say(
                    f"trial {i} {fault:<5} {launcher:<12} recovered={r['recovered']} ttr={ttr} "
                    f"restored from {r['restored_from']}{why}"
                )
    kills = _kill_trials(args.kill_trials) if args.kill_trials > 0 else None
    summary = {
        "benchmark": "recovery",
        "trials": args.trials,
        "hidden": args.hidden,
        "reference_digest": reference,
        "inplace_launcher": "torchrun --max-restarts 1 (ettr's agent does not restart in place yet)",
        "faults": {f: {name: _summary(ts) for name, ts in by.items()} for f, by in results.items()},
        "kill_trials": kills,
        "bad_resumes": sum(1 for by in results.values() for ts in by.values() for t in ts if t["bad_resume"])
        + (kills["bad_resumes"] if kills else 0),
        "quick": args.quick,
    }
    for fault, by in summary["faults"].items():
        for launcher, s in by.items():
            med = "-" if s["median_ttr_s"] is None else f"{s['median_ttr_s']:.3f} s"
            worst = "-" if s["worst_ttr_s"] is None else f"{s['worst_ttr_s']:.3f} s"
            print(
                f"{fault:<5} {launcher:<12} recovered {s['recovered']}/{s['trials']}  median TTR {med}  worst {worst}"
                f"  restored from {s['restored_from']}"
            )
            if "parts_median_s" in s:
                print(
                    "      parts (median s): " + ", ".join(f"{n} {v}" for n, v in s["parts_median_s"].items())
                )
    if kills is not None:
        print(
            f"kill trials: {kills['trials']} SIGKILLs ({kills['landed']}), completed {kills['completed']}, "
            f"bad resumes {kills['bad_resumes']}, process restarts {kills['process_restarts']}, restores after "
            f"the raise from {kills['restored_from']}"
        )
    print(f"bad resumes (final state not an uninterrupted run's): {summary['bad_resumes']}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SIGKILL trials with spares: a resilient 2-rank job under `ettr run` whose ranks and parked spares are killed
at random (docs/inplace.md, "Spares"; issue 29's "never less safe").

Each trial runs `ettr run --max-restarts 10 -- torchrun --standalone --nproc-per-node 2 -m
ettr.testing.resilient_job` (a commit every 5 steps, 0.05 s steps), waits until the job's ranks exist, then 0-4 s
more (the start-up, rendezvous and restore, or the 4 s of training), then SIGKILLs 1-3 processes
picked at random among the job's ranks and parked spares, 0.05-1.5 s apart, so that a second kill often lands
in the recovery the first one started.

A trial is good when the job completes (exit 0) with the final parameters of an uninterrupted run of the same
job (its digest, computed first without ettr) and leaves no process of the job behind. A killed spare must be
no failure of the job. A trial whose kills keep landing in the recoveries can end with the restart policy's
"restarts would not help" (exit 3): counted as `gave_up`, not as a bad resume.

The final state is checked on every ending: a completed trial's by its ranks' "done" digest, and every
trial's (completed or not) by its last committed checkpoint, read back (`resilient_job.committed_digests`)
and compared with the uninterrupted run's checkpoint of the same step (that run keeps all of them). A trial
that gave up after its last step (training over) must have committed the uninterrupted run's final state.

Figures (`--json`): `trials`, `completed`, `bad_resumes` (completed with other parameters), `left_behind`
(processes of any trial alive after it ended), `gave_up`, `gave_up_after_last_step` (of those, the trials whose
last committed checkpoint is the job's last step), `states_checked` (trials whose last committed checkpoint was
compared: every trial that committed one), `bad_states` (a last committed checkpoint other than the uninterrupted
run's at its step, or a completed trial whose last commit is not its last step), `kills` (`rank`, `spare`),
`trials_without_kill` (the job ended before the first kill, or the process picked was gone), `spares_promoted`
(trials whose recovery promoted a spare), `spare_kills_failed` (trials whose only kills were spares and that
booked a failure). `--quick`: 2 trials (100 by default). Exit status 1 when a trial resumed badly, ended with a
bad state or left a process.

Measured (2 cores shared with other sessions): docs/inplace.md, "Spares".
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

JOB_ARGS = ("--steps", "80", "--step-s", "0.05", "--every", "5")
LAST_STEP = 80
# The uninterrupted run keeps every checkpoint: each step a trial may stop at is comparable.
REFERENCE_ARGS = ("--keep-last", "100")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(work / "memory"))
    return env


def _job(work: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ettr.testing.resilient_job", "--ckpt-dir", str(work / "ckpt"), "--timings", str(work / "log.jsonl"),
        *JOB_ARGS, *extra,
    ]  # fmt: skip


def _committed(work: Path) -> dict[int, str]:
    """The model digest of each committed checkpoint the job left in `work` (none: {})."""
    from ettr.testing.resilient_job import committed_digests

    if not (work / "ckpt").is_dir():
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming the intent is to load in a single process"
        return committed_digests(str(work / "ckpt"))


def _digests(work: Path) -> set[str]:
    log = work / "log.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    return {e["digest"] for e in lines if e.get("ev") == "done"}


def _targets(supervisor_pid: int, run_dir: Path) -> list[tuple[int, bool]]:
    """The job's ranks and spares, (pid, is a spare): the supervisor's children forked from its zygote (ettr's
    agent adopts them), the zygote itself (the oldest of them) left out."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == supervisor_pid and stat[0] != "Z" and b"ettr.bootstrap.zygote" in cmdline:
            found.append((int(stat[19]), int(name)))
    spares = set()
    for path in glob.glob(str(run_dir / "agent" / "spares" / "*.parked")):
        try:
            spares.add(int(json.loads(Path(path).read_text())["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return [(pid, pid in spares) for _, pid in sorted(found)[1:]]


def _left_behind(work: Path) -> list[int]:
    """Processes whose environment names this trial's memory folder (every process of its job has it)."""
    mark = os.fsencode(work / "memory")
    left = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if mark in Path(f"/proc/{name}/environ").read_bytes():
                    left.append(int(name))
            except OSError:
                pass
    return left


def _tier_restores(work: Path) -> int:
    """The ranks' restores of a memory-tier commit (`--memory-interval`) in this trial's job log."""
    try:
        lines = (work / "log.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    return sum('"tier": "memory"' in line for line in lines)


def _trial(
    work: Path, rng: random.Random, want: set[str], reference: dict[int, str], extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    work.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "ettr.cli",
        "run",
        "--max-restarts",
        "10",
        "--run-dir",
        str(work / "run"),
    ]
    with open(work / "out", "wb") as out:
        job = subprocess.Popen(
            [*command, "--", *_job(work, *extra)], env=_env(work), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    killed: list[str] = []
    # From the moment the job's ranks exist, not from the launch: under load (15+ here) the start-up alone
    # outlasted a fixed 3.5-7 s and 45 of the first 65 trials of a run killed nothing.
    deadline = time.monotonic() + 300
    while not _targets(job.pid, work / "run") and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 4.0))  # the job trains 80 steps of 0.05 s (4 s) after its start-up
    for _ in range(rng.choice((1, 1, 2, 3))):
        targets = _targets(job.pid, work / "run")
        if not targets:
            break
        pid, is_spare = rng.choice(targets)
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append("spare" if is_spare else "rank")
        except OSError:
            pass
        time.sleep(rng.uniform(0.05, 1.5))
    try:
        code: int | str = job.wait(300)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        code = "timeout"
    time.sleep(1.0)
    left = _left_behind(work)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    text = (work / "out").read_text(errors="replace")
    committed = _committed(work)
    last = max(committed, default=None)
    state_ok = (
        None if last is None else committed[last] == reference.get(last) and (code != 0 or last == LAST_STEP)
    )
    return {
        "exit": code,
        "killed": killed,
        "digest_ok": _digests(work) == want,
        "last_commit": last,
        "state_ok": state_ok,
        "left_behind": len(left),
        "spare_promoted": "from a parked spare" in text,
        "gave_up": "restarts would not help" in text,
        "failures": text.count(" failed: "),
        "tier_restores": _tier_restores(work),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 trials")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    parser.add_argument(
        "--memory-interval", default=None, help="the trials keep memory-tier commits (auto or seconds)"
    )
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    trials = 2 if args.quick else args.trials
    rng = random.Random(args.seed)
    extra = ("--memory-interval", args.memory_interval) if args.memory_interval else ()
    root = Path(tempfile.mkdtemp(prefix="ettr-spare-kills-"))
    kept = False
    try:
        reference = root / "reference"
        reference.mkdir()
        subprocess.run(
            _job(reference, *REFERENCE_ARGS),
            env=_env(reference),
            capture_output=True,
            check=True,
            timeout=600,
        )
        want = _digests(reference)
        steps = _committed(reference)
        if set(steps) != set(range(5, LAST_STEP + 1, 5)) or {steps[LAST_STEP]} != want:
            raise SystemExit(
                f"the uninterrupted run's checkpoints {steps} do not match its final digest {want}"
            )
        _say(f"uninterrupted digest {sorted(want)}, its {len(steps)} checkpoints read back")
        load_start = os.getloadavg()
        rows = []
        for n in range(trials):
            row = _trial(root / f"trial-{n}", rng, want, steps, extra)
            rows.append(row)
            _say(
                f"trial {n} exit {row['exit']} killed {row['killed']} digest_ok {row['digest_ok']} "
                f"last commit {row['last_commit']} state_ok {row['state_ok']} "
                f"left {row['left_behind']} spare promoted {row['spare_promoted']} failures {row['failures']}"
            )
            if row["exit"] == 0 and row["digest_ok"] and row["state_ok"] and not row["left_behind"]:
                shutil.rmtree(root / f"trial-{n}", ignore_errors=True)
            else:
                kept = True
                _say(f"  kept: {root / f'trial-{n}'}")
    finally:
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    completed = [r for r in rows if r["exit"] == 0]
    figures = {
        "benchmark": "spare_kills",
        "trials": trials,
        "completed": len(completed),
        "gave_up": sum(r["gave_up"] for r in rows),
        "gave_up_after_last_step": sum(r["gave_up"] and r["last_commit"] == LAST_STEP for r in rows),
        "bad_resumes": sum(not r["digest_ok"] for r in completed),
        "states_checked": sum(r["state_ok"] is not None for r in rows),
        "bad_states": sum(r["state_ok"] is False for r in rows),
        "left_behind": sum(r["left_behind"] for r in rows),
        "kills": {kind: sum(r["killed"].count(kind) for r in rows) for kind in ("rank", "spare")},
        "trials_without_kill": sum(not r["killed"] for r in rows),
        "spares_promoted": sum(r["spare_promoted"] for r in rows),
        "spare_kills_failed": sum(
            bool(r["killed"]) and set(r["killed"]) == {"spare"} and r["failures"] > 0 for r in rows
        ),
        "memory_interval": args.memory_interval,
        "tier_restores": sum(r["tier_restores"] for r in rows),
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "quick": bool(args.quick),
    }
    print(
        f"{figures['completed']}/{trials} completed ({figures['gave_up']} gave up, "
        f"{figures['gave_up_after_last_step']} of them after the last step), bad resumes {figures['bad_resumes']}, "
        f"final states checked {figures['states_checked']} (last committed checkpoint against the uninterrupted "
        f"run's), bad {figures['bad_states']}, left behind {figures['left_behind']}, kills {figures['kills']} "
        f"({figures['trials_without_kill']} trials killed nothing: the job ended first), "
        f"spares promoted in {figures['spares_promoted']}, spare kills that failed the job "
        f"{figures['spare_kills_failed']}, memory-tier restores {figures['tier_restores']} (ranks), "
        f"load {figures['load_avg_start'][0]} -> {figures['load_avg_end'][0]}"
    )
    if args.json:
        print(json.dumps(figures))
    bad = (
        figures["bad_resumes"]
        or figures["bad_states"]
        or figures["left_behind"]
        or figures["spare_kills_failed"]
    )
    ended = (
        len(completed) + figures["gave_up"]
    )  # the restart policy may give up on kills that land in recovery
    return 1 if bad or ended < trials else 0


if __name__ == "__main__":
    sys.exit(main())

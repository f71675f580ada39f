"""Time to recover a 2-rank job: plain torchrun, ettr's process restart (from storage, from memory) and ettr's
restart in place, interleaved, after a crash and a SIGKILL.

The job (`ettr.testing.resilient_job`: 2-rank gloo DDP, ettr's CheckpointManager, a checkpoint every 10 steps,
35 steps) fails once on rank 1 after step 25: `crash` raises an exception, `kill` SIGKILLs the rank. Launchers:
    torchrun      `torchrun --max-restarts 1`, the job without memory copies (restores from storage)
    ettr          `ettr run --max-restarts 1 -- torchrun ...`, no memory copies: ettr's process restart
    ettr_memory   the same with memory copies: the restarted ranks restore from memory
    ettr_inplace  the job under `ettr.resilient`, run by `ettr run --max-restarts 1 -- torchrun ...`: ettr's
                  agent restarts it in place (docs/inplace.md): after a crash the same processes go on, a
                  killed rank is replaced (from its warm standby) and joins the survivor; memory copies on
    torchrun_inplace  (not run unless named) the job under `ettr.resilient` run by `torchrun --max-restarts 1`:
                  a crash is restarted in place among the same processes; a killed rank is not replaced (no
                  one starts a replacement without `ettr run`): torchrun's agent stops its peer and starts
                  both again, cold, and they restore from memory (a peer left waiting gives up after
                  `--rendezvous-timeout-s`)
    torchrun_fresh_store  (not run unless named) `torchrun` with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
                  plain torchrun's restart fails on this torch (2.4 and later) when a restarted rank reads its
                  peer's gloo address of the previous launch from the agent's store, which torchrun keeps
                  for the whole job (pytorch/pytorch#135712; docs/inplace.md); without the shared store rank
                  0 hosts a new one in every launch. A failed trial's line ends with its last error.
The rank fails once it has trained `--fail-after-s` (default 15 s; the first 25 steps take well under that)
and, under `ettr run`, once the supervisor's standbys are warm (at most `--standby-wait-max-s`, default 120 s):
a job that trained a while, as one that fails after hours has its standbys ready (on a busy machine their
warm-up at idle priority takes longer than 15 s; `standbys_warm_s` says when they were). `relaunch_paths`
says how each replacement started (`warm`, or `promoted`: a standby still warming; `forked` from the zygote;
`spare`: a spare that had parked). Under ettr's agent the in-place job's fault also waits for its spares to
park (one per rank, `agent/spares/*.parked`); `ETTR_SPARES=0` in this benchmark's environment turns the
trials' spares off.
A recovery succeeded when the command exited 0, trained to the last step after the fault, and both ranks end
with the parameters of an uninterrupted run (`bad_resumes` counts the others). TTR is measured the same way
for all, from the job's own timestamps: the fault to the first step completed after the post-fault restore,
split into `detect_relaunch_s` (fault -> the generation or process that recovers starts training: detection,
teardown, relaunch, imports, rendezvous), `build_restore_s` (model, checkpoint manager and restore) and
`first_step_s`. For the ettr launchers the ledger's parts (`EttReport.ttr_parts`) are given too.

Then `--node-trials` node losses of a two-node job (two `ettr run` agents on this machine, one rank each,
a shared SQLite ledger, each node's shared memory a directory of its own), with memory copies and without:
once the job has committed twice, node 1's supervisor and rank are SIGKILLed and its shared memory removed; a
replacement node joins; rank 1 restores from the copy node 0 holds for it (`peer`), or from storage.

Then `--kill-trials` SIGKILL trials of restart in place (`ettr.testing.inplace_faults`): the job restarts in
place after a raise on rank 1, and a random rank is SIGKILLed at a random moment, half of them aimed at that
recovery; a launcher of the harness's own restarts both ranks after a death. Each trial must end with the
parameters of an uninterrupted run.

    python benchmarks/recovery.py [--trials 10] [--faults crash,kill] [--launchers ...] [--hidden 512]
        [--kill-trials 100] [--budget-s S] [--json]

`--budget-s`: no new round, node loss or kill trial starts after S seconds (on a busy machine the full run
takes hours); the figures are of the trials that ran (`rounds_run`). A trial that did not recover keeps its
directory (its log, run directory and checkpoints) and says where.

`--quick` (what CI runs): one crash trial of each launcher with a small model, one node loss (memory), 1
kill trial (tests/test_inplace.py runs several).

`--json` ends with one object: `faults.<fault>.<launcher>`: trials, recovered, bad_resumes, median and worst TTR
(s), each trial's TTR, parts_median_s (the log's parts, and for ettr the ledger's), restored_from (counts);
`node_loss.<memory|storage>`: the same figures per variant; `kill_trials`: trials, completed, bad_resumes, landed (counts: before_raise, recovery, after_recovery,
not_fired), process_restarts, restored_from; `bad_resumes`: of everything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

LAUNCHERS = ("torchrun", "ettr", "ettr_memory", "ettr_inplace")
STANDBYS_WARM = "standbys-warm"
"""Made in a trial's directory once the supervisor's standbys (or its zygote) are warm: the job's fault waits
for it."""
_READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}.get(platform.machine())
_RECVMSG_SYSCALL = {"x86_64": "47", "aarch64": "212"}.get(platform.machine())
EXTRA_LAUNCHERS = ("torchrun_inplace", "torchrun_fresh_store")
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""`torchrun_fresh_store`: torchrun's agent does not share its store with the workers; rank 0 hosts a new
one in every launch, so a restart never meets the previous launch's gloo keys (docs/inplace.md)."""
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
        "--fail-after-s", f"{args.fail_after_s:g}",
    ]  # fmt: skip
    if launcher == "torchrun_inplace":  # nobody replaces a dead rank: its peer gives up after this
        job += ["--rendezvous-timeout-s", f"{args.rendezvous_timeout_s:g}"]
    if launcher.startswith("ettr") and args.standby_wait_max_s > 0:  # the fault waits for the standbys too
        job += ["--fail-when", str(work / STANDBYS_WARM), "--fail-wait-max-s", f"{args.standby_wait_max_s:g}"]
    if not launcher.endswith("_inplace"):
        job.append("--no-resilient")
    if launcher in ("torchrun", "torchrun_fresh_store", "ettr"):
        job.append("--no-memory-copy")
    elif launcher.startswith("ettr") and args.memory_interval:  # memory-tier commits where memory restores
        job += ["--memory-interval", args.memory_interval]
    return job


def _command(launcher: str, work: Path, fault: str, args: argparse.Namespace) -> list[str]:
    job = _job(work, launcher, fault, args)
    if launcher.startswith("torchrun"):
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
    if last_restore.get("tier") == "memory":  # a memory-tier commit (`--memory-interval`)
        out["restored_from"] += "-tier"
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
    first = report.ttr_parts[0]
    parts: dict[str, Any] = {f"ledger_{k}": v for k, v in first.parts_s.items() if v is not None}
    parts["ledger_total_s"] = first.total_s
    parts["ledger_kind"] = first.kind
    parts["ledger_relaunch_path"] = first.relaunch_path
    return parts


def _trial(launcher: str, fault: str, args: argparse.Namespace, reference: str | None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ettr-recovery-{launcher}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(work / "memory"))
    if not _spares_on():
        env["ETTR_SPARES"] = "0"
    if launcher == "torchrun_fresh_store":
        env.update(FRESH_STORE)
    started = time.monotonic()
    # A session of its own: a trial that times out is ended with every process it started (torchrun's
    # workers outlive their agent's SIGKILL otherwise).
    with open(work / "stderr.log", "wb") as stderr:
        proc = subprocess.Popen(
            _command(launcher, work, FAULTS.get(fault, fault), args),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    waits = launcher.startswith("ettr") and args.standby_wait_max_s > 0
    spares = work / "run" / "agent" / "spares" if launcher == "ettr_inplace" and _spares_on() else None
    watch = _StandbyWatch(proc.pid, work / STANDBYS_WARM, spares=spares) if waits else None
    try:
        rc = _wait_or_end(proc, args.timeout_s)
        tail = [
            _last_error(work / "stderr.log") if rc is not None else f"timed out after {args.timeout_s:g} s"
        ]
    finally:
        if watch is not None:
            watch.done.set()
            watch.join()
    leftover = _end_leftovers(work)
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
        # what the job left behind once its command ended: processes, memory copies (or the in-place store)
        "leftover_processes": leftover,
        "leftover_memory": sorted(p.name for p in (work / "memory").glob("*")) if rc == 0 else [],
    }
    if watch is not None:  # when the standbys were warm (None: not within --standby-wait-max-s of training)
        result["standbys_warm_s"] = None if watch.warm_at is None else round(watch.warm_at - started, 3)
    if launcher.startswith("ettr") and (work / "run").exists():
        ledger = _ledger_parts(work / "run")
        result["kind"] = ledger.pop("ledger_kind", None)
        result["relaunch_path"] = ledger.pop("ledger_relaunch_path", None)
        result["parts_s"] = {**found["parts_s"], **ledger}
    _keep_if_failed(result, work, bad, tail)
    return result


class _StandbyWatch(threading.Thread):
    """Makes `flag` once the standbys `ettr run` (process `parent`) keeps for the next attempt are warm: one
    per rank, each blocked reading its pipe for the attempt (`ettr.bootstrap.standby`). The job's fault waits
    for it (`--fail-when`), as a job that trained a while has its standbys ready: the figures are those of a
    failure after the warm-up, not of one that races it (that path, `promoted`, is in docs/supervisor.md)."""

    def __init__(self, parent: int, flag: Path, ranks: int = 2, *, spares: Path | None = None) -> None:
        super().__init__(name="standby-watch", daemon=True)
        self.parent, self.flag, self.ranks, self.spares = parent, flag, ranks, spares
        self.done = threading.Event()
        self.warm_at: float | None = None
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.1):
            found = _standbys(self.parent)
            ready = len(found) >= self.ranks and all(_reading(*s) for s in found)
            if self.spares is not None and len(list(self.spares.glob("*.parked"))) < self.ranks:
                continue  # an in-place job under ettr's agent: its spares park once it has trained
            if _READ_SYSCALL is None or ready or _zygote_waits(self.parent):
                self.warm_at = time.monotonic()
                self.flag.touch()
                return


def _spares_on() -> bool:
    """Whether ettr's agent forks spares for the in-place trials (`ETTR_SPARES=0` in this benchmark's
    environment: no; the trials' own environment drops every other `ETTR_` name)."""
    return os.environ.get("ETTR_SPARES", "").strip() != "0"


def _standbys(parent: int, module: bytes = b"ettr.bootstrap.standby") -> list[tuple[int, int]]:
    """(pid, pipe fd) of each standby process `parent` started (`module`: or its zygote and its forks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if module in argv:
                found.append((int(entry.name), int(argv[argv.index(module) + 1])))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _zygote_waits(parent: int) -> bool:
    """Whether the zygote of `ettr run` (process `parent`; `ettr.bootstrap.zygote`, used instead of
    standbys) is warm: blocked in recvmsg(2) on its socket, waiting for the next fork request."""
    for pid, fd in _standbys(parent, b"ettr.bootstrap.zygote"):
        try:
            fields = Path(f"/proc/{pid}/syscall").read_text().split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] == _RECVMSG_SYSCALL and int(fields[1], 16) == fd:
            return True
    return False


def _reading(pid: int, fd: int) -> bool:
    """Whether process `pid` is blocked in read(2) on `fd` (its warm-up done, it waits for an attempt)."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] == _READ_SYSCALL and int(fields[1], 16) == fd


def _last_line(path: Path) -> str:
    """The last line of `path` that says something (not a rule of '=' or '-')."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return next((x.strip() for x in reversed(lines) if x.strip().strip("=-")), "")


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b: \S.*)$")
_SOURCE = re.compile(r"\[/[^\]]*\] ")


def _last_error(path: Path) -> str:
    """The last exception `path` (a trial's stderr) reports with a message, without the source paths gloo
    puts in it (`RuntimeError: Gloo connectFullMesh failed with timed out connecting: SO_ERROR: Connection
    refused, remote=...`): torchrun's own last line only points to its docs; else the last line."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    found = next((m.group(1) for x in reversed(lines) if (m := _ERROR_LINE.match(x.strip()))), None)
    return _SOURCE.sub("", found) if found else _last_line(path)


def _end_leftovers(work: Path) -> int:
    """Kill the processes still running that belong to the trial (their command line or environment names
    `work`: workers, standbys), none of which should outlive its command by more than a moment; how many
    there were."""

    def running() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if str(work).encode() in (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    if not _wait_for(lambda: not running(), 2.0):  # a process of its teardown, on its way out
        for pid in (found := running()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        return len(found)
    return 0


def _keep_if_failed(result: dict[str, Any], work: Path, bad: bool, tail: list[str]) -> None:
    """A trial that recovered leaves nothing; one that did not keeps its directory (logs, run directory,
    checkpoints) for a look, and says where."""
    if result["recovered"]:
        shutil.rmtree(work, ignore_errors=True)
        return
    result["why"] = "final state differs from the uninterrupted run" if bad else (tail[0] if tail else "")
    result["kept"] = str(work)


def _wait_or_end(proc: subprocess.Popen[Any], timeout_s: float) -> int | None:
    """`proc`'s exit status; None when it ran past `timeout_s`, after ending its whole session (`proc` was
    started in a session of its own: torchrun's workers outlive their agent's SIGKILL otherwise)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()
        return None


def _reference(args: argparse.Namespace) -> str | None:
    """The final digest of an uninterrupted run of the same job."""
    work = Path(tempfile.mkdtemp(prefix="ettr-recovery-reference-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(OMP_NUM_THREADS="1", ETTR_MEMORY_DIR=str(work / "memory"))
    try:
        # A session of its own, as a trial's: a reference run that hangs is ended with its workers.
        proc = subprocess.Popen(
            [*_torchrun(0), *_job(work, "torchrun", "none", args)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        _wait_or_end(proc, args.timeout_s)
        digests = _measure(work / "log.jsonl")["digests"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return digests[0] if len(digests) == 1 else None


def _wait_for(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)  # another process makes it true
    return False


def _node_loss_trial(memory: bool, args: argparse.Namespace, reference: str | None) -> dict[str, Any]:
    """Two nodes on this machine (two `ettr run` of one `torchrun --nnodes 2` job, one rank each, a shared
    SQLite ledger, each node's shared memory a directory of its own). Once the job has trained past its
    second commit, node 1 is lost: its supervisor and its rank SIGKILLed and its shared memory gone; a
    replacement node 1 (a new `ettr run`, as a scheduler would start) joins, and both restore — rank 1
    from the copy node 0 holds for it (`memory_replicas`), or from storage without memory copies."""
    from ettr.supervisor.launch import free_port

    work = Path(tempfile.mkdtemp(prefix=f"ettr-recovery-node-{'memory' if memory else 'storage'}-"))
    log = work / "log.jsonl"
    url, port = f"sqlite:///{work / 'ledger.db'}", free_port()
    job = [
        "-m", "ettr.testing.resilient_job", "--no-resilient", "--ckpt-dir", str(work / "ckpt"),
        "--timings", str(log), "--steps", str(NUM_STEPS), "--every", str(EVERY), "--fault", "none",
        "--hidden", str(args.hidden), "--step-s", f"{args.step_s * 10:g}",
    ]  # fmt: skip
    if not memory:
        job.append("--no-memory-copy")

    def node(rank: int) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", ETTR_MEMORY_DIR=str(work / f"memory{rank}"))
        command = [
            sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(work / f"node{rank}"), "--ledger", url,
            "--job-id", "node-loss", "--peer-timeout", "4", "--max-restarts", "2", "--",
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
            "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--local-addr=127.0.0.{rank + 1}", *job,
        ]  # fmt: skip
        return subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )

    def events() -> list[dict[str, Any]]:
        if not log.exists():
            return []
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip().endswith("}")]

    started = time.monotonic()
    nodes = [node(0), node(1)]
    result: dict[str, Any] = {"memory": memory}
    try:
        past = 2 * EVERY + 3  # two commits (and their copies, and the peers' copies of them) are in
        if not _wait_for(
            lambda: any(e["ev"] == "step" and e["step"] >= past for e in events()), args.timeout_s
        ):
            raise TimeoutError(f"the job did not reach step {past}")
        ranks = {e["rank"]: e["pid"] for e in events() if e["ev"] == "start"}
        fault_ts = time.time()
        os.killpg(nodes[1].pid, 9)  # the node is gone: its supervisor, its rank, its shared memory
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranks[1], 9)
        shutil.rmtree(work / "memory1", ignore_errors=True)
        with open(log, "a") as f:
            f.write(
                json.dumps({"ts": fault_ts, "pid": ranks[1], "ev": "fault", "rank": 1, "step": None}) + "\n"
            )
        nodes[1].wait()
        nodes[1] = node(1)  # the replacement node
        for n in nodes:
            n.wait(timeout=args.timeout_s)
        rc: int | None = nodes[0].returncode if nodes[1].returncode == 0 else nodes[1].returncode
        tail = (nodes[0].stderr.read() if nodes[0].stderr else b"").decode(errors="replace").splitlines()[-1:]
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        rc, tail = None, [str(exc)]
        for n in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(n.pid, 9)
    found = _measure(log)
    after = [e for e in events() if e["ev"] == "restored" and e.get("step")]
    bad = reference is not None and bool(found["digests"]) and found["digests"] != [reference]
    result.update(
        rc=rc,
        recovered=rc == 0 and found["done"] and not bad,
        bad_resume=bad,
        ttr_s=found["ttr_s"],
        parts_s=found["parts_s"],
        restored_from=found["restored_from"],
        restored_by_rank={str(e["rank"]): e["source"] for e in after},
        wall_s=time.monotonic() - started,
    )
    _keep_if_failed(result, work, bad, tail)
    return result


def _kill_trials(count: int, in_budget: Any, memory_interval: str | None = None) -> dict[str, Any]:
    from ettr.testing.inplace_faults import InPlaceTrialRunner

    # A trial with a survivor that did not give up on its dead peer keeps its directory (the survivor's stacks
    # are in it, `InPlaceTrial.detail` says where): the work directory is then kept, and said.
    workdir = tempfile.mkdtemp(prefix="ettr-inplace-kills-")
    runner: InPlaceTrialRunner | None = None
    try:
        runner = InPlaceTrialRunner(workdir, seed=count, memory_interval=memory_interval)
        _say(f"kill trials: the job trains {runner.calibrate():.2f} s with its raise and no kill")
        trials = []
        for i in range(count):
            if not in_budget():
                _say(f"the budget is spent: {i} of {count} kill trials ran")
                break
            t = runner.run_trial(i, during_recovery=i % 2 == 0)
            trials.append(t)
            if t.bad or not t.completed or t.detail:
                _say(f"  kill trial {i}: {t}")
            if (i + 1) % 10 == 0:
                _say(f"  {i + 1} kill trials done")
    finally:
        if runner is not None and runner.hung:
            _say(f"kill trials: kept {workdir} (a survivor that did not give up: its stacks are there)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
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
        "hung_survivors": runner.hung,
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
        "leftover_processes": sum(t.get("leftover_processes", 0) for t in trials),
        "leftover_memory": sum(len(t.get("leftover_memory", ())) for t in trials),
    }
    for t in trials:
        source = t["restored_from"] or "none"
        out["restored_from"][source] = out["restored_from"].get(source, 0) + 1
    for key in ("kind", "relaunch_path"):
        seen = [t[key] or "none" for t in trials if key in t]
        if seen:
            out[key + "s"] = {v: seen.count(v) for v in dict.fromkeys(seen)}
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
        "--launchers",
        default=",".join(LAUNCHERS),
        help="comma-separated: " + ", ".join((*LAUNCHERS, *EXTRA_LAUNCHERS)),
    )
    parser.add_argument(
        "--hidden", type=int, default=512, help="the model's width (state ~ 3 x 17 x hidden floats)"
    )
    parser.add_argument("--step-s", type=float, default=0.02, help="sleep per step")
    parser.add_argument(
        "--rendezvous-timeout-s", type=float, default=5.0, help="torchrun_inplace: a dead rank's wait"
    )
    parser.add_argument(
        "--fail-after-s",
        type=float,
        default=15.0,
        help="the fault waits until the rank has trained this long",
    )
    parser.add_argument(
        "--standby-wait-max-s",
        type=float,
        default=120.0,
        help="under ettr run the fault also waits until the standbys are warm, at most this long",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a trial still running then failed")
    parser.add_argument("--kill-trials", type=int, default=100, help="in-place SIGKILL trials (0: none)")
    parser.add_argument(
        "--node-trials", type=int, default=3, help="node losses of a two-node job, with and without memory"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new round (and no node-loss or kill trial) after this many seconds; the summary says "
        "how many ran",
    )
    parser.add_argument(
        "--memory-interval",
        default=None,
        help="ettr launchers with memory copies keep memory-tier commits (auto or seconds; default: off)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="one crash trial per launcher, a small model (CI)"
    )
    args = parser.parse_args()
    if args.quick:
        args.trials, args.faults, args.hidden, args.kill_trials = 1, "crash", 64, 1
        args.fail_after_s, args.node_trials, args.standby_wait_max_s = 0.0, 1, 0.0
    faults = [f for f in args.faults.split(",") if f]
    launchers = [name for name in args.launchers.split(",") if name]
    known = (*LAUNCHERS, *EXTRA_LAUNCHERS)
    bad = [f for f in faults if f not in FAULTS] + [name for name in launchers if name not in known]
    if bad or args.trials < 1 or args.hidden < 1:
        print(f"recovery.py: bad --faults/--launchers {bad}, or --trials/--hidden below 1", file=sys.stderr)
        return 2
    load_start = [round(x, 1) for x in os.getloadavg()]
    began = time.monotonic()

    def in_budget() -> bool:
        return args.budget_s is None or time.monotonic() - began < args.budget_s

    reference = _reference(args)
    if reference is None:
        _say("the uninterrupted reference run failed: final states are not compared")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        f: {name: [] for name in launchers} for f in faults
    }
    rounds = 0
    for i in range(args.trials):
        if not in_budget():
            _say(f"--budget-s {args.budget_s:g} spent: {i} of {args.trials} rounds ran")
            break
        rounds += 1
        for fault in faults:
            order = launchers[i % len(launchers) :] + launchers[: i % len(launchers)]  # interleaved, rotated
            for launcher in order:
                r = _trial(launcher, fault, args, reference)
                results[fault][launcher].append(r)
                ttr = "-" if r["ttr_s"] is None else f"{r['ttr_s']:.3f} s"
                why = "" if r["recovered"] else f" ({r.get('why', '')[:160]}; kept {r['kept']})"
                path = f" path {r['relaunch_path']}" if r.get("relaunch_path") else ""
                warm = f" standbys warm at {r['standbys_warm_s']} s" if "standbys_warm_s" in r else ""
                _say(
                    f"trial {i} {fault:<5} {launcher:<12} recovered={r['recovered']} ttr={ttr} "
                    f"restored from {r['restored_from']}{path}{warm}{why}"
                )
    node_loss: dict[str, list[dict[str, Any]]] = {"memory": [], "storage": []}
    for i in range(args.node_trials):
        if not in_budget():
            _say(f"--budget-s {args.budget_s:g} spent: {i} of {args.node_trials} node-loss rounds ran")
            break
        for variant in ("memory", "storage")[: 1 if args.quick else 2]:
            r = _node_loss_trial(variant == "memory", args, reference)
            node_loss[variant].append(r)
            ttr = "-" if r["ttr_s"] is None else f"{r['ttr_s']:.3f} s"
            why = "" if r["recovered"] else f" ({r.get('why', '')[:100]}; kept {r['kept']})"
            _say(
                f"node loss {i} {variant:<7} recovered={r['recovered']} ttr={ttr} restored "
                f"{r['restored_by_rank']}{why}"
            )
    kills = _kill_trials(args.kill_trials, in_budget, args.memory_interval) if args.kill_trials > 0 else None
    summary = {
        "benchmark": "recovery",
        "trials": args.trials,
        "rounds_run": rounds,
        "budget_s": args.budget_s,
        "hidden": args.hidden,
        "reference_digest": reference,
        "fail_after_s": args.fail_after_s,
        "load_avg_start": load_start,
        "load_avg_end": [round(x, 1) for x in os.getloadavg()],
        "faults": {f: {name: _summary(ts) for name, ts in by.items()} for f, by in results.items()},
        "node_loss": {v: _summary(ts) for v, ts in node_loss.items() if ts},
        "kill_trials": kills,
        "bad_resumes": sum(1 for by in results.values() for ts in by.values() for t in ts if t["bad_resume"])
        + sum(1 for ts in node_loss.values() for t in ts if t["bad_resume"])
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
                + (f"  kinds {s['kinds']}" if "kinds" in s else "")
                + (f"  paths {s['relaunch_paths']}" if "relaunch_paths" in s else "")
                + f"  left behind: {s['leftover_processes']} processes, {s['leftover_memory']} memory copies"
            )
            if "parts_median_s" in s:
                print(
                    "      parts (median s): " + ", ".join(f"{n} {v}" for n, v in s["parts_median_s"].items())
                )
    for variant, s in summary["node_loss"].items():
        med = "-" if s["median_ttr_s"] is None else f"{s['median_ttr_s']:.3f} s"
        worst = "-" if s["worst_ttr_s"] is None else f"{s['worst_ttr_s']:.3f} s"
        by_rank = [t["restored_by_rank"] for t in node_loss[variant]]
        print(
            f"node loss ({variant}) recovered {s['recovered']}/{s['trials']}  median TTR {med}  worst {worst}"
            f"  restored (rank: source) {by_rank}"
        )
    if kills is not None:
        print(
            f"kill trials: {kills['trials']} SIGKILLs ({kills['landed']}), completed {kills['completed']}, "
            f"bad resumes {kills['bad_resumes']}, process restarts {kills['process_restarts']}, survivors that did "
            f"not give up on a dead peer {kills['hung_survivors']}, restores after "
            f"the raise from {kills['restored_from']}"
        )
    print(f"bad resumes (final state not an uninterrupted run's): {summary['bad_resumes']}")
    print(f"load average (1, 5, 15 min) at the start {load_start}, at the end {summary['load_avg_end']}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

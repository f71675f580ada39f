"""Staging slots under SIGKILL (real processes): a process killed while it stages into the slot, between the
seal and the swap, right after the swap, or while a restore maps the copy leaves a memory copy that is the
committed one or none at all — never a torn one, never one newer than the commit — and no more files than
one copy, one slot and the bookkeeping (docs/checkpointing.md, "Memory used").

Each process of the chain pauses at its moment (it writes a marker, then sleeps) and is SIGKILLed there; the
next one restores and says from where and what, and is killed at the next moment; the last trains to the
end, which must be bit-identical to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEPS = 10

CHILD = r"""
import json, os, sys, time, zlib
import torch
from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.checkpoint import memory, snapshot, staging
from ettr.checkpoint import restoring as restoring_module

point, log, root, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
saving = {"step": 0}


def say(**fields):
    with open(log, "a") as f:
        f.write(json.dumps(fields) + "\n")


def pause(at):
    if at == point:
        say(ev="paused", point=at, step=saving["step"])
        time.sleep(600)


real_stage, real_buffer_for = staging.ReusedStager.stage, staging.ReusedStager._buffer_for
counted = {"stages": 0, "lent": 0}


def stage(self, state_dict, **kwargs):
    if self._lent:
        counted["stages"] += 1
        counted["lent"] = 0
    return real_stage(self, state_dict, **kwargs)


def buffer_for(self, key, tensor):
    # the second view of the slot written by the second stage into a slot: after a swap, so the copy
    # then is a slot that was staged into before (the stager must have let go of its views)
    if key in self._lent and counted["stages"] == 2:
        counted["lent"] += 1
        if counted["lent"] == 2:
            pause("stage_mid")
    return real_buffer_for(self, key, tensor)


real_seal = snapshot.seal


class SealOs:
    def __getattr__(self, name):
        return getattr(os, name)

    def pwrite(self, fd, data, offset):
        if offset == 0 and bytes(data) == snapshot.MAGIC:
            pause("seal_before_magic")  # header and byte strings written, the magic not yet
        return os.pwrite(fd, data, offset)


def seal(*args, **kwargs):
    snapshot.os = SealOs()
    try:
        return real_seal(*args, **kwargs)
    finally:
        snapshot.os = os


real_exchange = memory._exchange


def exchange(a, b):
    pause("pre_exchange")
    swapped = real_exchange(a, b)
    pause("post_exchange")
    return swapped


real_fill = memory.fill


def fill(target, loaded, where=""):
    pause("restore_fill")  # the copy is mapped, checked, and not yet copied into the state
    return real_fill(target, loaded, where)


staging.ReusedStager.stage = stage
staging.ReusedStager._buffer_for = buffer_for
snapshot.seal = seal
memory._exchange = exchange
restoring_module.fill = fill


def digest(model, optimizer):
    crc = 0
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        crc = zlib.crc32(t.detach().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
config = CheckpointConfig(root=root, interval=IntervalConfig(every_steps=10**6))
with CheckpointManager(config, TrainState(model=model, optimizer=optimizer)) as ckpt:
    step = ckpt.restore() or 0
    say(ev="restored", step=step, source=ckpt.restored_from, digest=digest(model, optimizer))
    while step < steps:
        step += 1
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        say(ev="step", step=step, digest=digest(model, optimizer))
        saving["step"] = step
        assert ckpt.save(step, wait=True)
say(ev="done", step=step, digest=digest(model, optimizer))
"""


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _run(script: Path, point: str, log: Path, root: Path, env: dict[str, str]) -> dict[str, Any] | None:
    """Run one process of the chain; with a `point`, SIGKILL it once it pauses there and return the pause."""
    before = len(_events(log))
    proc = subprocess.Popen(
        [sys.executable, str(script), point, str(log), str(root), str(STEPS)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        if not point:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err.decode()[-2000:]
            return None
        deadline = time.monotonic() + 300  # a guard against a hang, not a measurement
        while time.monotonic() < deadline and proc.poll() is None:
            paused = [e for e in _events(log)[before:] if e["ev"] == "paused"]
            if paused:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return paused[0]
            time.sleep(0.02)
        _, err = proc.communicate(timeout=5) if proc.poll() is not None else (None, b"")
        raise AssertionError(f"the process never paused at {point}: {(err or b'').decode()[-2000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_sigkills_at_the_slots_moments_leave_the_committed_copy_or_none(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    shm = Path("/dev/shm")  # where the copies live in a job: tmpfs and its RENAME_EXCHANGE
    memory_dir = (
        shm / f"ettr-test-slot-kills-{uuid.uuid4().hex[:8]}"
        if shm.is_dir() and os.access(shm, os.W_OK)
        else None
    )
    memory_dir = memory_dir or tmp_path / "shm"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(PYTHONWARNINGS="ignore", ETTR_MEMORY_DIR=str(memory_dir))
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        reference_log = tmp_path / "reference.log"
        _run(script, "", reference_log, tmp_path / "reference", env)
        reference = {e["step"]: e["digest"] for e in _events(reference_log) if e["ev"] == "step"}
        final = [e["digest"] for e in _events(reference_log) if e["ev"] == "done"]

        log, root = tmp_path / "job.log", tmp_path / "ckpt"
        # (moment, where the next restore must read, which step: the one being saved, or the one before)
        chain = [
            ("stage_mid", "memory", -1),  # the slot half-written: the copy of the step before is intact
            ("seal_before_magic", "storage", 0),  # committed, not swapped in: the copy is stale, storage
            ("pre_exchange", "storage", 0),
            ("post_exchange", "memory", 0),  # swapped in: the copy is the commit, before the views are let go
            ("restore_fill", "memory", 0),  # killed while the restore maps the copy: it stays intact
        ]
        expected: tuple[str, int] | None = None
        for point, source, offset in chain:
            before = len(_events(log))
            paused = _run(script, point, log, root, env)
            assert paused is not None
            restored = [e for e in _events(log)[before:] if e["ev"] == "restored"]
            assert len(restored) == (0 if point == "restore_fill" else 1)  # killed in its restore: none
            for r in restored:
                if expected is not None:
                    assert (r["source"], r["step"]) == expected, (point, r)
                assert r["step"] == 0 or r["digest"] == reference[r["step"]]
            if point != "restore_fill":
                expected = (source, paused["step"] + offset)
            leftovers = {
                "lease" if p.name.startswith("lease-") else p.name
                for p in memory_dir.rglob("*")
                if p.is_file()
            }
            assert leftovers <= {"rank-0.snap", ".rank-0.snap.staging", "owner", "lease"}, leftovers
        before = len(_events(log))
        _run(script, "", log, root, env)
        events = _events(log)[before:]
        restored = [e for e in events if e["ev"] == "restored"]
        assert expected is not None and (restored[0]["source"], restored[0]["step"]) == expected
        assert restored[0]["digest"] == reference[restored[0]["step"]]
        assert [e["digest"] for e in events if e["ev"] == "done"] == final
    finally:
        if memory_dir.parent == shm:
            shutil.rmtree(memory_dir, ignore_errors=True)

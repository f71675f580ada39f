"""Memory-tier commits (`ettr.checkpoint.memory_tier`): restored only when every rank holds the same one.

Real two-rank gloo jobs (`ettr.testing.spawn`): one trains and keeps memory-tier copies after its last
storage commit, a restarted one restores; each copy's damage or disagreement must send every rank to the
same storage commit.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.checkpoint.memory import MemoryCopies
from ettr.checkpoint.memory_tier import MemoryTier
from ettr.checkpoint.policy import MemoryIntervalPolicy, parse_memory_interval
from ettr.checkpoint.snapshot import MAGIC, Binding, open_snapshot
from ettr.events import EventKind, Phase
from ettr.ledger.base import MemoryLedger
from ettr.run_env import memory_root
from ettr.testing.recorder import SyncRecorder
from test_checkpoint_memory import _dist_state  # the same two-rank DDP state as the copies' own tests

STORAGE_EVERY = 5
TRAINED = 13
"""Phase one trains 13 steps: storage commits 5 and 10, then a memory-tier copy of step 13."""


def _digest(state: TrainState) -> list[bytes]:
    """Plain bytes: parameters, optimizer moments, this rank's RNG."""
    tensors = [*state.model.state_dict().values(), torch.get_rng_state()]
    for per_param in state.optimizer.state.values():
        tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return [t.contiguous().numpy().tobytes() for t in tensors]


def _config(root: str, **changes: Any) -> CheckpointConfig:
    options: dict[str, Any] = {
        "interval": IntervalConfig(every_steps=STORAGE_EVERY),
        "memory_interval": 3600.0,
    }
    options.update(changes)
    return CheckpointConfig(root=root, **options)


def _train(
    state: TrainState, manager: CheckpointManager, steps: range, sleep_s: float = 0.0
) -> dict[int, Any]:
    digests = {}
    for step in steps:
        loss = state.model(torch.randn(4, 8)).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        manager.after_step(step)
        digests[step] = _digest(state)
        time.sleep(sleep_s)
    return digests


def _first_run(rank: int, world_size: int, root: str, extra: str) -> dict[str, Any]:
    """Train to step 13 (storage commits 5 and 10), then keep a memory-tier copy of 13 on every rank, as an
    agreed memory-tier save does (`extra`: what else happens before the ranks die)."""
    state = _dist_state(rank, world_size)
    with CheckpointManager.create(_config(root), state, recorder=SyncRecorder(MemoryLedger())) as manager:
        assert manager.restore() is None
        digests = _train(state, manager, range(1, TRAINED + 1))
        manager.wait()  # step 10 committed on every rank: the memory-tier copy is made after it
        manager._save_memory_tier(TRAINED)
        if extra == "rank1_newer" and rank == 1:  # rank 1 alone saved again (the others killed first)
            manager._save_memory_tier(TRAINED + 1)
        tier_path = str(manager._tier.path()) if manager._tier is not None else ""
    return {"digests": digests, "tier_path": tier_path}


def _restart(rank: int, world_size: int, root: str, then_save: bool, memory_copy: bool) -> dict[str, Any]:
    state = _dist_state(rank, world_size)
    recorder = SyncRecorder(MemoryLedger())
    config = _config(root) if memory_copy else _config(root, memory_copy=False, memory_interval=None)
    with CheckpointManager.create(config, state, recorder=recorder) as manager:
        restored = manager.restore()
        result = {
            "restored": restored,
            "source": manager.restored_from,
            "tier": manager.restored_tier,
            "last_committed": manager.last_committed_step,
            "digest": _digest(state),
            "restores": [
                dict(e.data or {})
                for e in recorder.events()
                if e.kind is EventKind.PHASE_END and e.phase is Phase.RESTORE
            ],
            "resumed": [e.step for e in recorder.events() if e.kind is EventKind.RESUMED],
        }
        if then_save:  # a preemption's save right after the restore: the step restored from memory only
            result["saved"] = manager.save(restored or 0, wait=True)
    return result


def _tier_paths(root: str) -> list[Path]:
    directory = memory_root()
    assert directory is not None
    return [MemoryTier(MemoryCopies.for_root(directory, root, rank=r)).path() for r in range(2)]


def _rebind(path: Path, **changes: Any) -> None:
    """Rewrite the header of the snapshot at `path` in place with `changes` (of the same length), its
    CRC-32 recomputed and its payload kept: a copy whose checks pass but whose binding is another's."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[len(MAGIC) : len(MAGIC) + 8])
    body = json.loads(bytes(raw[len(MAGIC) + 8 : len(MAGIC) + 8 + length]))
    body.pop("header_crc32")
    body.update(changes)
    body["header_crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    header = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert len(header) <= length
    raw[len(MAGIC) + 8 : len(MAGIC) + 8 + length] = header.ljust(length)
    path.write_bytes(bytes(raw))


def _run(fn: Any, *args: Any) -> list[dict[str, Any]]:
    from ettr.testing.spawn import run_ranks

    return run_ranks(fn, 2, *args, timeout_s=240)


@pytest.mark.slow
def test_two_ranks_restore_the_memory_tier_commit_bit_for_bit_and_a_save_of_it_reaches_storage(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "ckpt")
    first = _run(_first_run, root, "")
    assert all(Path(p).is_file() for p in (r["tier_path"] for r in first))
    restarted = _run(_restart, root, True, True)
    for rank, result in enumerate(restarted):
        assert (result["restored"], result["source"], result["tier"]) == (TRAINED, "memory", "memory")
        assert result["digest"] == first[rank]["digests"][TRAINED]  # parameters, moments, RNG: bit for bit
        assert result["resumed"] == [TRAINED]  # the books count the steps after 13 as lost, no more
        assert result["last_committed"] == 2 * STORAGE_EVERY  # storage's, not 13: the save below writes 13
        (restore,) = result["restores"]
        assert (restore["source"], restore["tier"], restore["storage_step"]) == ("memory", "memory", 10)
        assert result["saved"] is True
    # the step restored from memory is now in storage: a restore from storage alone gives it, bit for bit
    from_storage = _run(_restart, root, False, False)
    for rank, result in enumerate(from_storage):
        assert (result["restored"], result["source"]) == (TRAINED, "storage")
        assert result["digest"] == first[rank]["digests"][TRAINED]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["magic", "payload", "rank1_newer", "lineage", "base_digest"])
def test_a_memory_tier_copy_not_every_rank_holds_intact_sends_every_rank_to_the_storage_commit(
    tmp_path: Path, damage: str
) -> None:
    root = str(tmp_path / "ckpt")
    first = _run(_first_run, root, damage)
    rank1 = _tier_paths(root)[1]
    if damage == "magic":  # torn: a kill while the slot was written reads as no snapshot
        with open(rank1, "r+b") as f:
            f.write(bytes(len(MAGIC)))
    elif damage == "payload":
        data = bytearray(rank1.read_bytes())
        (length,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
        body = json.loads(bytes(data[len(MAGIC) + 8 : len(MAGIC) + 8 + length]))
        data_offset = (len(MAGIC) + 8 + length + 63) // 64 * 64
        data[data_offset + body["tensors"][0]["at"][0]] ^= 0x01  # a bit of the first tensor flipped
        rank1.write_bytes(bytes(data))
    elif damage == "lineage":  # rank 1's copy of the same step, from another process lifetime
        with open_snapshot(rank1) as snap:
            lineage = snap.info.binding.lineage
        _rebind(rank1, lineage="f" * len(lineage))
    elif damage == "base_digest":  # both copies made after a storage commit that is not storage's newest
        for path in _tier_paths(root):
            _rebind(path, manifest_sha256="0" * 64)
    restarted = _run(_restart, root, False, True)
    for rank, result in enumerate(restarted):
        assert (result["restored"], result["tier"]) == (2 * STORAGE_EVERY, None)  # every rank: the same step
        assert result["source"] == "memory"  # the storage commit's own memory copy, as before
        assert result["digest"] == first[rank]["digests"][2 * STORAGE_EVERY]
        assert result["last_committed"] == 2 * STORAGE_EVERY
        said = [r.get("tier_not_used") for r in result["restores"] if r.get("tier") is None]
        assert said[-1] if damage != "base_digest" else said == [None]  # booked where some rank held one


def _agreed_run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The memory-tier saves of `after_step` (a short interval, steps of ~20 ms): agreed, so at the same
    steps on every rank, and never at a storage save's step."""
    state = _dist_state(rank, world_size)
    recorder = SyncRecorder(MemoryLedger())
    config = _config(root, memory_interval=0.05, interval=IntervalConfig(every_steps=10))
    with CheckpointManager.create(config, state, recorder=recorder) as manager:
        manager.restore()
        digests = _train(state, manager, range(1, 41), sleep_s=0.02)
        manager.wait()
        steps = [
            e.step
            for e in recorder.events()
            if e.kind is EventKind.PHASE_END
            and e.phase is Phase.CHECKPOINT_BLOCKING
            and (e.data or {}).get("tier") == "memory"
        ]
    return {"steps": steps, "digests": digests}


@pytest.mark.slow
def test_memory_tier_saves_are_agreed_and_one_older_than_the_newest_commit_is_not_restored(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "ckpt")
    first = _run(_agreed_run, root)
    steps = first[0]["steps"]
    assert steps and steps == first[1]["steps"]  # the same steps on both ranks
    assert not any(step % 10 == 0 for step in steps)  # never where a storage save starts
    restarted = _run(_restart, root, False, True)
    for rank, result in enumerate(restarted):  # storage's commit of 40 came after every memory-tier copy
        assert (result["restored"], result["tier"]) == (40, None)
        assert result["digest"] == first[rank]["digests"][40]
    assert restarted[0]["restored"] == restarted[1]["restored"]


# -- pure parts ------------------------------------------------------------------------------------------------


def test_memory_interval_parses_and_refuses_nonsense() -> None:
    assert parse_memory_interval(None) is None
    assert parse_memory_interval("auto") == "auto"
    assert parse_memory_interval("2s") == 2.0 and parse_memory_interval(0.5) == 0.5
    for bad in ("0", "-1s", "soon", float("inf"), True):
        with pytest.raises(ValueError):
            parse_memory_interval(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CheckpointConfig(root="x", memory_interval="never")
    with pytest.raises(ValueError, match="memory_copy"):
        CheckpointConfig(root="x", memory_interval="auto", memory_copy=False)


def test_the_auto_memory_interval_is_young_daly_from_the_memory_saves_own_cost() -> None:
    policy = MemoryIntervalPolicy("auto", now_s=0.0, failures_per_day=lambda now_s: 86400.0 / 60)
    assert policy.should_save(0.0)  # the first one measures the cost
    policy.observe(cost_s=0.005, now_s=1.0)
    interval = policy.interval_s(1.0)
    assert 0.7 < interval < 0.8  # sqrt(2 x 0.005 s x 60 s) ~ 0.77 s
    assert not policy.should_save(1.5) and policy.should_save(1.0 + interval + 1e-6)


def test_a_storage_tier_restore_never_takes_a_memory_tier_copy(tmp_path: Path) -> None:
    copies = MemoryCopies(tmp_path / "copies", rank=0)
    tier = MemoryTier(copies)
    binding = Binding(step=12, manifest_sha256="ab" * 32, world_size=1, lineage="cd" * 8, base_step=10)
    state = {"w": torch.arange(6, dtype=torch.float32), "meta": b"x"}
    assert tier.keep(state, binding) > 0
    os.replace(tier.path(), copies.own_path())  # as if it sat where the storage commit's copy lives
    found = copies.find(Binding(step=12, manifest_sha256="ab" * 32, world_size=1))
    assert found.snapshot is None and "memory-tier" in found.reason


def test_a_memory_tier_copy_is_swapped_in_whole_and_its_slot_reused(tmp_path: Path) -> None:
    copies = MemoryCopies(tmp_path / "copies", rank=0)
    tier = MemoryTier(copies)
    newest = Binding(step=10, manifest_sha256="ab" * 32, world_size=1)
    for step in (11, 12, 13):
        state = {"w": torch.full((4, 3), float(step)).t(), "meta": b"step %d" % step}  # a transposed view too
        binding = Binding(step=step, manifest_sha256="ab" * 32, world_size=1, lineage="cd" * 8, base_step=10)
        assert tier.keep(state, binding) > 0
        assert not tier.staging_path().exists() or open_snapshot_fails(tier.staging_path())
        found = tier.find(newest=newest)
        assert found.snapshot is not None and found.key == (step, "cd" * 8)
        loaded = found.snapshot.load()
        assert torch.equal(loaded["w"], state["w"]) and loaded["meta"] == b"step %d" % step
        del loaded
        found.snapshot.close()
    stale = tier.find(newest=Binding(step=13, manifest_sha256="ab" * 32, world_size=1))
    assert stale.snapshot is None and "stale" in stale.reason
    other = tier.find(newest=Binding(step=10, manifest_sha256="ef" * 32, world_size=1))
    assert other.snapshot is None and "stale" in other.reason
    tier.remove()
    assert not tier.path().exists() and not tier.staging_path().exists()


def open_snapshot_fails(path: Path) -> bool:
    """A slot is never a snapshot: its magic is cleared while it is written, and before it is lent again."""
    try:
        open_snapshot(path).close()
    except Exception:
        return True
    return False

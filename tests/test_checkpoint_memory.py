"""Memory copies of committed checkpoints: the snapshot format refuses torn, stale and forged copies, and a
restore from memory gives exactly the state a restore from storage gives (docs/checkpointing.md)."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.checkpoint.base import MANIFEST_NAME, CheckpointInvalid, step_dir_name
from ettr.checkpoint.memory import MemoryCopies, fill
from ettr.checkpoint.snapshot import Binding, SnapshotUnsupported, _align, open_snapshot, parse_bytes, write
from ettr.events import EventKind, Phase
from ettr.ledger.base import MemoryLedger
from ettr.run_env import memory_dirs_of_run, memory_root
from ettr.testing import toyjob
from ettr.testing.recorder import SyncRecorder

BINDING = Binding(step=7, manifest_sha256="ab" * 32, world_size=1)


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor(2.5)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, dtype=torch.bfloat16)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"], "fused": None}],
        },
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0, 5, dtype=torch.int64),
        "meta": b"\x80\x02pickled-bytes",
        "name": "x",
        "count": 4,
        "inf": float("inf"),
    }


def _write(path: Path, state: dict[str, Any] | None = None, **kwargs: Any) -> int:
    return write(path, state or _state(), binding=BINDING, rank=0, created_ts=1.0, **kwargs)


def test_a_snapshot_gives_back_every_leaf_of_the_state(tmp_path: Path) -> None:
    path = tmp_path / "s.snap"
    _write(path)
    with open_snapshot(path) as snap:
        assert snap.info.binding == BINDING and snap.info.rank == 0
        loaded = snap.load()
        expected = _state()
        assert torch.equal(loaded["model"]["w"], expected["model"]["w"])
        assert loaded["model"]["b"].shape == () and float(loaded["model"]["b"]) == 2.5
        assert loaded["optim"]["state"][0]["exp_avg"].dtype == torch.bfloat16  # an int key stays an int
        assert loaded["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
        assert loaded["optim"]["param_groups"][0]["fused"] is None
        assert loaded["flags"].tolist() == [True, False] and loaded["empty"].shape == (0, 5)
        assert loaded["meta"] == expected["meta"] and loaded["name"] == "x" and loaded["count"] == 4
        assert loaded["inf"] == float("inf")
        del loaded


@pytest.mark.parametrize(
    "damage", ["truncate_payload", "truncate_header", "flip_payload", "flip_header", "magic", "header_length"]
)
def test_a_torn_or_flipped_snapshot_is_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "s.snap"
    size = _write(path)
    data = bytearray(path.read_bytes())
    if damage == "truncate_payload":
        data = data[: size - 3]
    elif damage == "truncate_header":
        data = data[:40]
    elif damage == "flip_payload":
        data[data.index(b"pickled-bytes")] ^= 0x10  # a byte of the state (padding between entries is unused)
    elif damage == "flip_header":
        data[30] ^= 0x01
    elif damage == "magic":
        data[0:8] = b"NOTSNAP!"
    elif damage == "header_length":
        data[8:16] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointInvalid):
        with open_snapshot(path) as snap:
            snap.load()


def _reheader(path: Path, **changes: Any) -> None:
    """Rewrite the header of the snapshot at `path` with `changes`, its CRC-32 recomputed (a forger's copy)."""
    import json
    import struct
    import zlib

    from ettr.checkpoint.snapshot import MAGIC

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[len(MAGIC) : len(MAGIC) + 8])
    body = json.loads(raw[len(MAGIC) + 8 : len(MAGIC) + 8 + length])
    body.pop("header_crc32")
    body.update(changes)
    body["header_crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    header = json.dumps(body).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(header)) + header)  # the payload is not looked at first


@pytest.mark.parametrize(
    "changes",
    [
        {"created_ts": 10**400},  # OverflowError out of find(): the restore raised, every attempt
        {"created_ts": float("nan")},
        {"created_ts": True},
        {"tensors": [{"at": [0, 4], "dtype": "float32", "shape": [10**400] * 2000 + [0]}]},
        {"tensors": [{"at": [0, 4], "dtype": "float32", "shape": [10**400] * 2000}]},  # minutes of bignums
    ],
    ids=["created_overflows", "created_nan", "created_bool", "zero_dim_huge", "huge_shape"],
)
def test_a_forged_header_is_a_copy_not_used_never_an_exception(tmp_path: Path, changes: dict) -> None:
    copies = MemoryCopies(tmp_path / "copies", rank=0)
    copies.directory.mkdir(mode=0o700)
    _write(copies.own_path())
    _reheader(copies.own_path(), **changes)
    found = copies.find(BINDING)
    assert found.snapshot is None and "memory copy unusable" in found.reason


@pytest.mark.parametrize(
    "tree", [None, {"d": [["f", {"f": 10**400}]]}], ids=["no_tree", "float_out_of_range"]
)
def test_a_forged_tree_whose_payload_verifies_is_refused_by_load_never_an_exception(
    tmp_path: Path, tree: Any
) -> None:
    # Its header's CRC and the payload's are anyone's to compute: `load` raised KeyError or OverflowError.
    import json
    import struct
    import zlib

    from ettr.checkpoint.snapshot import MAGIC

    path = tmp_path / "s.snap"
    _write(path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[len(MAGIC) : len(MAGIC) + 8])
    payload = raw[_align(len(MAGIC) + 8 + length) :]
    body = json.loads(raw[len(MAGIC) + 8 : len(MAGIC) + 8 + length])
    del body["header_crc32"], body["tree"]
    if tree is not None:
        body["tree"] = tree
    body["header_crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    header = json.dumps(body).encode()
    start = len(MAGIC) + 8 + len(header)
    forged = MAGIC + struct.pack("<Q", len(header)) + header + bytes(_align(start) - start) + payload
    with pytest.raises(CheckpointInvalid):
        parse_bytes(bytearray(forged)).load()


def test_what_a_snapshot_cannot_hold_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    class Custom:
        pass

    for bad in ({"x": Custom()}, {"x": torch.ones(2).to_sparse()}, {(1, 2): torch.ones(1)}):
        with pytest.raises(SnapshotUnsupported):
            _write(tmp_path / "bad.snap", bad)
        assert not (tmp_path / "bad.snap").exists()


def test_fill_loads_in_place_and_refuses_another_shape() -> None:
    target = {"w": torch.zeros(2, 2), "meta": b"", "groups": [{"lr": 0.0}]}
    live = target["w"]
    fill(target, {"w": torch.ones(2, 2), "meta": b"m", "groups": [{"lr": 0.5}]})
    assert target["w"] is live and torch.equal(live, torch.ones(2, 2))
    assert target["meta"] == b"m" and target["groups"][0]["lr"] == 0.5
    with pytest.raises(CheckpointInvalid, match="shape"):
        fill({"w": torch.zeros(2, 2)}, {"w": torch.ones(3)})
    with pytest.raises(CheckpointInvalid, match="lacks"):
        fill({"w": torch.zeros(2)}, {})


# -- the manager ----------------------------------------------------------------------------------------------


class _Crash(Exception):
    pass


def _train_until_crash(root: Path, crash_after: int, *, every: int = 5, **config: Any) -> None:
    """Run the toy job, saving every `every` steps, and crash (an exception) after step `crash_after`."""
    job = toyjob.ToyJob(root=str(root), num_steps=40, every_steps=every, hidden=32)

    def on_step(step: int) -> None:
        if step == crash_after:
            raise _Crash

    with pytest.raises(_Crash):
        toyjob.run(job, recorder=SyncRecorder(MemoryLedger()), on_step=on_step)


def _restore(root: Path, **config: Any) -> tuple[int | None, str, str | None, SyncRecorder]:
    """Restore `root` as a restarted toy job would: (step, state digest, where from, its recorder)."""
    job = toyjob.ToyJob(root=str(root), hidden=32)
    state, _, _ = toyjob._build(job)
    recorder = SyncRecorder(MemoryLedger())
    cfg = CheckpointConfig(root=str(root), interval=IntervalConfig(every_steps=5), **config)
    with CheckpointManager(cfg, state, recorder=recorder) as manager:
        step = manager.restore()
        source = manager.restored_from
    return step, toyjob.state_digest(state), source, recorder


@pytest.fixture(scope="module")
def reference() -> dict[int, str]:
    return toyjob.reference_digests(toyjob.ToyJob(root="-", num_steps=40, hidden=32))


def _copies(root: Path) -> MemoryCopies:
    directory = memory_root()
    assert directory is not None
    return MemoryCopies.for_root(directory, str(root), rank=0)


def test_a_restart_restores_from_memory_exactly_what_storage_holds(tmp_path: Path, reference: dict) -> None:
    root = tmp_path / "ckpt"
    _train_until_crash(root, 13)
    assert _copies(root).own_path().is_file()
    step, digest, source, recorder = _restore(root)
    assert (step, source) == (10, "memory")
    assert digest == reference[10]  # bit-identical to the uninterrupted run after step 10
    restores = [e for e in recorder.events() if e.kind is EventKind.PHASE_END and e.phase is Phase.RESTORE]
    assert [e.data.get("source") for e in restores] == ["memory"]
    step, digest, source, _ = _restore(root, memory_copy=False)
    assert (step, source, digest) == (10, "storage", reference[10])


def test_a_stale_copy_is_never_used(tmp_path: Path, reference: dict) -> None:
    """A rank killed between a commit and its memory copy leaves the copy of an older step."""
    root = tmp_path / "ckpt"
    _train_until_crash(root, 7)
    old = tmp_path / "step5.snap"
    shutil.copy(_copies(root).own_path(), old)
    step, digest, source, _ = _restore(root)
    assert (step, source) == (5, "memory")
    shutil.rmtree(root)
    _copies(root).own_path().unlink()
    _train_until_crash(root, 12)  # commits 5 and 10 again
    shutil.copy(old, _copies(root).own_path())  # ... but the copy is still step 5's
    step, digest, source, recorder = _restore(root)
    assert (step, source, digest) == (10, "storage", reference[10])
    # ... and the books say why storage was read on a node that kept its copy (they said nothing)
    (restore,) = [e for e in recorder.events() if e.kind is EventKind.PHASE_END and e.phase is Phase.RESTORE]
    assert restore.data["source"] == "storage"
    assert restore.data["memory_not_used"] == (
        "rank 0: memory copy not used: it holds step 5, the newest commit is step 10 (stale)"
    )


def test_a_copy_of_another_commit_of_the_same_step_is_not_used(tmp_path: Path, reference: dict) -> None:
    root = tmp_path / "ckpt"
    _train_until_crash(root, 12)
    manifest = root / step_dir_name(10) / MANIFEST_NAME
    # The same step committed again (another run into this root, signed with this user's key like the
    # first): the copy is bound to the first commit's manifest.
    from dataclasses import replace

    from ettr.checkpoint.commit import Manifest
    from ettr.checkpoint.keys import KeyRing

    parsed = Manifest.from_json(manifest.read_bytes())
    recommitted = replace(parsed, created_ts=parsed.created_ts + 1.0)
    before = manifest.read_bytes()
    manifest.write_bytes(recommitted.to_json(KeyRing.open(None, create=True).signing))
    assert manifest.read_bytes() != before
    step, digest, source, _ = _restore(root)
    assert (step, source, digest) == (10, "storage", reference[10])


def test_a_corrupt_copy_falls_back_to_storage(tmp_path: Path, reference: dict) -> None:
    root = tmp_path / "ckpt"
    _train_until_crash(root, 12)
    path = _copies(root).own_path()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    step, digest, source, _ = _restore(root)
    assert (step, source, digest) == (10, "storage", reference[10])


def test_a_forged_copy_whose_pickled_part_would_run_code_is_refused(tmp_path: Path, reference: dict) -> None:
    """Every check a forger can recompute passes (CRCs, binding); the pickled part still never runs."""
    root = tmp_path / "ckpt"
    _train_until_crash(root, 12)
    copies = _copies(root)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    with open_snapshot(copies.own_path()) as snap:
        loaded = {k: _clone(v) for k, v in snap.load().items()}
        binding = snap.info.binding
    loaded["meta"] = pickle.dumps(Evil())
    forged = tmp_path / "forged.snap"
    write(forged, loaded, binding=binding, rank=0, created_ts=2.0)
    os.replace(forged, copies.own_path())
    step, digest, source, _ = _restore(root)
    assert not marker.exists()
    assert (step, source, digest) == (10, "storage", reference[10])


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def test_the_copy_is_removed_when_the_job_completes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_dir = tmp_path / "run"
    job = toyjob.ToyJob(root=str(root), num_steps=12, every_steps=5, hidden=32)
    recorder = SyncRecorder(MemoryLedger(), run_dir=run_dir)
    seen: list[bool] = []

    def on_step(step: int) -> None:
        if step == 11:
            seen.append(_copies(root).own_path().is_file())
            seen.append(memory_dirs_of_run(run_dir) == [_copies(root).directory])

    toyjob.run(job, recorder=recorder, on_step=on_step)
    assert seen == [True, True]
    assert not _copies(root).directory.exists()


def test_one_ranks_clean_up_never_removes_a_file_another_rank_is_writing(tmp_path: Path) -> None:
    """Every rank writes the shared `owner` file; a rank removing the temporary files a kill left behind
    removed another rank's temporary `owner` mid-write, whose rename then failed and its copy with it."""
    mine, other = (MemoryCopies(tmp_path / "copies", rank=r) for r in (0, 1))
    mine.owner = other.owner = "/runs/job"
    assert mine.keep(_state(), BINDING) > 0
    in_flight = mine.directory / ".owner.r1.0123456789ab.tmp"  # rank 1 is writing the owner file now
    in_flight.write_text("/runs/job\n")
    stray = mine.directory / ".rank-0.snap.r0.0123456789ab.tmp"  # rank 0 was killed writing its copy
    stray.write_bytes(b"torn")
    (mine.directory / "owner").unlink()  # rank 0 writes the owner file again
    assert mine.keep(_state(), BINDING) > 0
    assert in_flight.exists() and not stray.exists()
    assert (mine.directory / "owner").read_text().strip() == "/runs/job"


@pytest.mark.slow
def test_a_job_that_failed_for_good_leaves_nothing_in_shared_memory(tmp_path: Path) -> None:
    """`ettr run` removes its job's memory copies at the job's end whatever the outcome (a completed job's
    ranks remove their own; a failed one's copies stayed in /dev/shm until a reboot)."""
    import subprocess
    import sys

    memory = tmp_path / "memory"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env["ETTR_MEMORY_DIR"] = str(memory)
    command = [
        sys.executable, "-m", "ettr", "run", "--run-dir", str(tmp_path / "run"), "--max-restarts", "0",
        "--inject", "crash@step=12", "--", sys.executable, "-m", "ettr.testing.toyjob",
        "--root", str(tmp_path / "ckpt"), "--steps", "20", "--every", "5",
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "InjectedCrash" in proc.stderr  # it failed after the commit of step 10 and its memory copy
    assert memory.is_dir() and not any(memory.iterdir())


def test_a_copy_over_its_limit_is_not_kept_and_the_old_one_goes(tmp_path: Path, reference: dict) -> None:
    root = tmp_path / "ckpt"
    _train_until_crash(root, 7)
    assert _copies(root).own_path().is_file()
    job = toyjob.ToyJob(root=str(root), num_steps=40, every_steps=5, hidden=32)
    state, loader, _ = toyjob._build(job)
    cfg = CheckpointConfig(root=str(root), interval=IntervalConfig(every_steps=5), memory_max_bytes=1024)
    with CheckpointManager(cfg, state, recorder=SyncRecorder(MemoryLedger())) as manager:
        assert manager.restore() == 5
        manager.save(6, wait=True)
    assert not _copies(root).own_path().exists()
    step, digest, source, _ = _restore(root)
    assert (step, source) == (6, "storage")


def test_a_memory_copy_needs_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("ETTR_MEMORY_DIR", str(shared))
    root = tmp_path / "ckpt"
    _train_until_crash(root, 7)  # the copy is refused, training is not disturbed
    assert not any(p.suffix == ".snap" for p in shared.rglob("*"))
    step, _, source, _ = _restore(root)
    assert (step, source) == (5, "storage")


def test_a_refused_memory_copy_folder_is_said_once_not_at_every_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Each save warned again ("ettr: memory copy of step 10 failed (... writable by others ...)", then of step
    # 20, 30, ...): the folder's problem, not the save's.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    copies = MemoryCopies.for_root(shared, str(tmp_path / "ckpt"), rank=0)
    with caplog.at_level("WARNING", logger="ettr"):
        for step in (10, 20, 30):
            assert copies.keep(_state(), Binding(step=step, manifest_sha256="ab" * 32, world_size=1)) == 0
    said = [r.getMessage() for r in caplog.records if "writable by others" in r.getMessage()]
    assert len(said) == 1 and "not kept" in said[0], said
    assert not any(p.suffix == ".snap" for p in shared.rglob("*"))


def test_snapshot_bytes_round_trip_through_a_buffer(tmp_path: Path) -> None:
    """What a peer sends (the file's bytes) parses the same as the file."""
    from ettr.checkpoint.snapshot import parse_bytes

    path = tmp_path / "s.snap"
    _write(path)
    snap = parse_bytes(bytearray(path.read_bytes()))
    assert torch.equal(snap.load()["model"]["w"], _state()["model"]["w"])
    buffer = io.BytesIO()
    torch.save({"x": 1}, buffer)  # unrelated bytes are not a snapshot
    with pytest.raises(CheckpointInvalid):
        parse_bytes(bytearray(buffer.getvalue()))


# -- two ranks ------------------------------------------------------------------------------------------------


def _dist_state(rank: int, world_size: int) -> TrainState:
    from torch.nn.parallel import DistributedDataParallel

    from ettr.checkpoint import ResumableSampler

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ResumableSampler(64, seed=0, rank=rank, world_size=world_size)
    torch.manual_seed(100 + rank)
    return TrainState(model=model, optimizer=optimizer, data=sampler)


def _dist_digest(state: TrainState) -> list[bytes]:
    """Plain bytes (tensors would travel back through shared memory that dies with the rank)."""
    tensors = [*state.model.state_dict().values(), torch.get_rng_state()]
    return [t.contiguous().numpy().tobytes() for t in tensors]


def _dist_run(rank: int, world_size: int, root: str, train: bool) -> dict[str, Any]:
    state = _dist_state(rank, world_size)
    config = CheckpointConfig(root=root, interval=IntervalConfig(every_steps=3))
    with CheckpointManager.create(config, state, recorder=SyncRecorder(MemoryLedger())) as manager:
        restored = manager.restore()
        if train:
            for step in range(1, 5):
                x = torch.randn(4, 8)
                loss = state.model(x).pow(2).mean()
                state.optimizer.zero_grad()
                loss.backward()
                state.optimizer.step()
                manager.after_step(step)
            manager.wait()
        return {"restored": restored, "source": manager.restored_from, "state": _dist_digest(state)}


@pytest.mark.slow
def test_two_ranks_restore_from_memory_only_when_every_rank_has_its_copy(tmp_path: Path) -> None:
    from ettr.testing.spawn import run_ranks

    root = str(tmp_path / "ckpt")
    run_ranks(_dist_run, 2, root, True, timeout_s=180)
    from_memory = run_ranks(_dist_run, 2, root, False, timeout_s=180)
    assert [(r["restored"], r["source"]) for r in from_memory] == [(3, "memory"), (3, "memory")]
    copies = MemoryCopies.for_root(memory_root(), root, rank=1)  # type: ignore[arg-type]
    copies.own_path().unlink()  # rank 1 lost its copy: both ranks read storage (one step for all)
    from_storage = run_ranks(_dist_run, 2, root, False, timeout_s=180)
    assert [(r["restored"], r["source"]) for r in from_storage] == [(3, "storage"), (3, "storage")]
    for memory, storage in zip(from_memory, from_storage, strict=True):
        assert memory["state"] == storage["state"]  # parameters and each rank's RNG, bit for bit


def test_a_copy_of_a_commit_admission_refuses_is_not_used(tmp_path: Path) -> None:
    """The newest manifest rewritten unsigned in a root this user signs in: storage refuses it, and so
    does the memory path, though the copy's binding was rewritten to match."""
    from dataclasses import replace

    from ettr.checkpoint.commit import Manifest

    root = tmp_path / "ckpt"
    _train_until_crash(root, 12)
    manifest = root / step_dir_name(10) / MANIFEST_NAME
    parsed = Manifest.from_json(manifest.read_bytes())
    unsigned = replace(parsed, key_id=None, signature=None).to_json()
    manifest.write_bytes(unsigned)
    copies = _copies(root)
    with open_snapshot(copies.own_path()) as snap:  # the forger also rebinds the copy to it
        loaded = {k: _clone(v) for k, v in snap.load().items()}
    binding = Binding(step=10, manifest_sha256=Binding.digest(unsigned), world_size=1)
    forged = tmp_path / "rebound.snap"
    write(forged, loaded, binding=binding, rank=0, created_ts=3.0)
    os.replace(forged, copies.own_path())
    step, _, source, _ = _restore(root)
    assert source != "memory" and step != 10


# -- peers on other nodes ---------------------------------------------------------------------------------------


def _node_run(rank: int, world_size: int, base: str, root: str, train: bool) -> dict[str, Any]:
    """A rank of a job of `world_size` one-rank nodes; each node's shared memory is its own directory."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["ETTR_MEMORY_DIR"] = os.path.join(base, f"node-{rank}")
    return _dist_run(rank, world_size, root, train)


@pytest.mark.slow
def test_a_replacement_node_restores_from_the_copy_its_peer_holds(tmp_path: Path) -> None:
    from ettr.testing.spawn import run_ranks

    base, root = str(tmp_path / "shm"), str(tmp_path / "ckpt")
    run_ranks(_node_run, 2, base, root, True, timeout_s=180)
    assert any((tmp_path / "shm" / "node-0").rglob("held-rank-1.snap"))  # rank 0 holds rank 1's copy
    assert any((tmp_path / "shm" / "node-1").rglob("held-rank-0.snap"))
    shutil.rmtree(
        tmp_path / "shm" / "node-1"
    )  # node 1 is lost with its memory; a replacement takes its place
    restored = run_ranks(_node_run, 2, base, root, False, timeout_s=180)
    assert [(r["restored"], r["source"]) for r in restored] == [(3, "memory"), (3, "peer")]
    from_storage = run_ranks(_dist_run, 2, root, False, timeout_s=180)  # (no memory copies in this dir)
    assert [r["source"] for r in from_storage] == ["storage", "storage"]
    for peer, storage in zip(restored, from_storage, strict=True):
        assert peer["state"] == storage["state"]  # bit for bit, each rank's RNG included


def test_the_job_ends_memory_sweep_reads_only_a_private_root_and_never_blocks(tmp_path) -> None:
    from ettr.run_env import MEMORY_DIR_ENV, memory_dirs_of_run, private_dir_problem

    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    run_dir = tmp_path / "run"
    mine = root / "ckpt-mine"
    mine.mkdir()
    (mine / "owner").write_text(f"{run_dir}\n")
    fifo = root / "ckpt-evil"
    fifo.mkdir()
    os.mkfifo(fifo / "owner")  # read as a file, it blocked `ettr run` at the job's end for good
    linked = root / "ckpt-linked"
    linked.mkdir()
    (linked / "owner").symlink_to(mine / "owner")
    env = {MEMORY_DIR_ENV: str(root)}
    assert memory_dirs_of_run(run_dir, env) == [mine]
    root.chmod(0o777)  # anyone could have planted what is in it
    assert "writable by others" in (private_dir_problem(root) or "")
    assert memory_dirs_of_run(run_dir, env) == []


def test_a_root_and_run_directory_whose_names_are_not_utf8_keep_their_copy(
    tmp_path: Path, reference: dict
) -> None:
    """Paths are bytes: a checkpoint root or run directory whose name is not UTF-8 (held as surrogates) made
    the copies' directory name, the key ring's signed-root record and the `owner` file raise
    UnicodeEncodeError: the first restore of such a root failed every attempt, and later every commit's
    retention and memory copy were skipped ("accounting for checkpoint N failed")."""
    root = tmp_path / os.fsdecode(b"ckpt-\xff")
    run_dir = tmp_path / os.fsdecode(b"run-\xfe")
    job = toyjob.ToyJob(root=str(root), num_steps=40, every_steps=5, hidden=32)
    seen: list[bool] = []

    def on_step(step: int) -> None:
        if step == 13:
            seen.append(memory_dirs_of_run(run_dir) == [_copies(root).directory])
            raise _Crash

    with pytest.raises(_Crash):
        toyjob.run(job, recorder=SyncRecorder(MemoryLedger(), run_dir=run_dir), on_step=on_step)
    assert seen == [True]
    assert _copies(root).own_path().is_file()
    step, digest, source, _ = _restore(root)
    assert (step, source, digest) == (10, "memory", reference[10])


# -- a later copy overwrites the one this process wrote, in place ------------------------------------------


def _keep(copies: MemoryCopies, scale: float, step: int = 7) -> int:
    state = _state()
    state["model"]["w"] = state["model"]["w"] * scale
    binding = Binding(step=step, manifest_sha256="ab" * 32, world_size=1)
    return copies.keep(state, binding)


def _loaded_w(path: Path) -> torch.Tensor:
    with open_snapshot(path) as snap:
        w = snap.load()["model"]["w"].clone()
    return w


def test_a_later_copy_reuses_the_file_this_process_wrote(tmp_path: Path) -> None:
    copies = MemoryCopies(tmp_path / "copies", rank=0)
    assert _keep(copies, 1.0) > 0
    first = os.stat(copies.own_path()).st_ino
    assert _keep(copies, 2.0, step=8) > 0
    assert os.stat(copies.own_path()).st_ino == first  # overwritten in place, not a new file
    assert torch.equal(_loaded_w(copies.own_path()), _state()["model"]["w"] * 2.0)
    with open_snapshot(copies.own_path()) as snap:
        assert snap.info.binding.step == 8


def test_a_copy_killed_while_overwritten_in_place_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state a SIGKILL leaves mid-overwrite (payload half new) reads as no snapshot at all."""
    from ettr.checkpoint import snapshot

    copies = MemoryCopies(tmp_path / "copies", rank=0)
    _keep(copies, 1.0)
    torn = tmp_path / "torn.snap"
    real = snapshot._pwrite_all
    calls = []

    def killed_after_one_piece(fd: int, data: memoryview, offset: int) -> None:
        calls.append(offset)
        real(fd, data, offset)
        if len(calls) == 1:
            shutil.copy(copies.own_path(), torn)  # what the file holds when the process dies here
            raise KeyboardInterrupt

    monkeypatch.setattr(snapshot, "_pwrite_all", killed_after_one_piece)
    with pytest.raises(KeyboardInterrupt):
        _keep(copies, 3.0, step=8)
    assert torn.read_bytes()[:8] == bytes(8)
    with pytest.raises(CheckpointInvalid, match="bad magic"):
        open_snapshot(torn)
    assert not copies.own_path().exists()  # and the writer, where it lives to see it, removes it
    monkeypatch.setattr(snapshot, "_pwrite_all", real)
    assert _keep(copies, 4.0, step=9) > 0  # the next copy is a new file
    assert torch.equal(_loaded_w(copies.own_path()), _state()["model"]["w"] * 4.0)


def test_a_copy_still_mapped_by_a_restore_is_never_overwritten(tmp_path: Path) -> None:
    copies = MemoryCopies(tmp_path / "copies", rank=0)
    _keep(copies, 1.0)
    first = os.stat(copies.own_path()).st_ino
    snap = open_snapshot(copies.own_path())
    alive = snap.load()["model"]["w"]  # a view of the mapped file, kept past close
    snap.close()
    _keep(copies, 5.0, step=8)
    assert os.stat(copies.own_path()).st_ino != first  # a new file, renamed over the old one
    assert torch.equal(alive, _state()["model"]["w"])  # the restored state did not change under it
    assert torch.equal(_loaded_w(copies.own_path()), _state()["model"]["w"] * 5.0)
    del alive


def test_a_copy_replaced_by_someone_else_is_not_written_through(tmp_path: Path) -> None:
    copies = MemoryCopies(tmp_path / "copies", rank=0)
    _keep(copies, 1.0)
    path = copies.own_path()
    other = tmp_path / "other"
    other.write_bytes(b"not ours")
    path.unlink()
    path.symlink_to(other)  # someone put a link where the copy was
    _keep(copies, 6.0, step=8)
    assert other.read_bytes() == b"not ours"
    assert not path.is_symlink()
    assert torch.equal(_loaded_w(path), _state()["model"]["w"] * 6.0)


def test_a_copy_found_under_a_folder_others_may_write_is_not_used(tmp_path: Path) -> None:
    # Whoever may write the folder above a job's copy folder can swap that folder for one of their own between
    # find's check of it and the open (a loop of renames wins the race): the job then restored their forged
    # state, bound to the commit by a digest anyone who reads the manifest computes. The folder above is checked.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ckpt").mkdir(mode=0o700)
    _write(shared / "ckpt" / "rank-0.snap")
    copies = MemoryCopies(shared / "ckpt", rank=0)
    assert copies.find(BINDING).snapshot is not None  # (the honest case)
    shared.chmod(0o777)
    found = copies.find(BINDING)
    assert found.snapshot is None and "writable by others" in found.reason, found.reason


def test_a_copy_folder_further_below_a_folder_others_may_write_is_not_used(tmp_path: Path) -> None:
    # ETTR_MEMORY_DIR=/data/team/me: `me` and its copy folder are private, `team` is anyone's to rename in.
    team = tmp_path / "team"
    (team / "me" / "ckpt").mkdir(parents=True, mode=0o700)
    os.chmod(team / "me", 0o700)
    _write(team / "me" / "ckpt" / "rank-0.snap")
    copies = MemoryCopies(team / "me" / "ckpt", rank=0)
    assert copies.find(BINDING).snapshot is not None
    team.chmod(0o777)
    found = copies.find(BINDING)
    assert found.snapshot is None and "without the sticky bit" in found.reason, found.reason
    team.chmod(0o1777)  # sticky (/dev/shm, /tmp): only the owner of `me` may rename it
    assert copies.find(BINDING).snapshot is not None


@pytest.mark.parametrize("problem", ["group_writable", "another_users"])
def test_a_snapshot_file_another_user_could_have_written_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    # The file itself, as opened (no race): a copy swapped in is another user's file.
    path = tmp_path / "s.snap"
    _write(path)
    if problem == "group_writable":
        path.chmod(0o660)
    else:
        owner = os.stat(path).st_uid
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(CheckpointInvalid, match="writable by others|not this user"):
        open_snapshot(path)


def test_a_fifo_in_place_of_a_copy_never_blocks_a_restore(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir(mode=0o700)
    os.mkfifo(tmp_path / "ckpt" / "rank-0.snap")
    found = MemoryCopies(tmp_path / "ckpt", rank=0).find(BINDING)
    assert found.snapshot is None and "FIFO" in found.reason, found.reason

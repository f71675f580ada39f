"""Forged checkpoints and anchors with every checksum recomputed never run code, with a key or without one
(issue 25 item 1). Each forgery is one an attacker who can write the checkpoint root makes
(`ettr.testing.forge`); the evidence that code ran is a marker file its command would create."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ettr.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    IntervalConfig,
    TrainState,
)
from ettr.checkpoint.base import step_dir_name
from ettr.ledger import MemoryLedger
from ettr.testing import forge
from ettr.testing.recorder import SyncRecorder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KEY = b"the job's own key"


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return TrainState(
        model=model, optimizer=optimizer, lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 5)
    )


def _config(root: Path, **kwargs) -> CheckpointConfig:
    return CheckpointConfig(root=root, interval=IntervalConfig(every_steps=1), keep_last=5, **kwargs)


def _save(root: Path, steps: list[int], **kwargs) -> None:
    rec = SyncRecorder(MemoryLedger())
    with CheckpointManager(_config(root, **kwargs), _state(), recorder=rec) as manager:
        for step in steps:
            assert manager.save(step, wait=True)


def _restore(root: Path, **kwargs) -> tuple[int | None, list]:
    rec = SyncRecorder(MemoryLedger())
    with CheckpointManager(_config(root, **kwargs), _state(), recorder=rec) as manager:
        step = manager.restore()
    return step, rec.events()


def _forge(kind: str, directory: Path, command: str, secret: bytes | None = None) -> None:
    if kind == "dotted-global":
        forge.plant_metadata(directory, forge.dotted_global_payload(command), secret=secret)
    elif kind == "load-from-bytes":
        forge.plant_metadata(directory, forge.load_from_bytes_payload(command), secret=secret)
    elif kind == "bytes-item":  # a pickled part (DCP's BYTE_IO) of the state itself
        forge.plant_bytes_item(directory, "meta", forge.torch_save_payload(command), secret=secret)
    elif kind == "tensor-as-bytes":  # a tensor's entry turned into a pickled object
        forge.plant_bytes_item(directory, "model.", forge.torch_save_payload(command), secret=secret)
    elif kind in OPCODES:
        forge.plant_metadata(directory, forge.opcode_payloads(command)[kind], secret=secret)
    else:  # pragma: no cover
        raise AssertionError(kind)


FORGERIES = ["dotted-global", "load-from-bytes", "bytes-item", "tensor-as-bytes"]
OPCODES = sorted(forge.opcode_payloads("true"))
"""Re-probe variants (issue 25): other opcodes and globals a `.metadata` could use to reach a callable."""


@pytest.mark.parametrize("kind", FORGERIES)
def test_a_forged_checkpoint_never_runs_code_without_a_key(tmp_path, kind, monkeypatch):
    monkeypatch.delenv("ETTR_CHECKPOINT_SECRET", raising=False)
    root, marker = tmp_path / "ckpt", tmp_path / "pwned"
    _save(root, [1, 2])
    _forge(kind, root / step_dir_name(2), forge.touch_command(marker))
    step, _events = _restore(root)
    assert not marker.exists(), f"the forged checkpoint ({kind}) ran code"
    assert step == 1  # the forged newest one was refused, the one before it loaded


@pytest.mark.parametrize("kind", FORGERIES + OPCODES)
def test_even_loaded_without_authentication_a_forgery_runs_nothing(tmp_path, kind, monkeypatch):
    # The explicit downgrade lets the unsigned forgery past the signature check: the allow-lists alone
    # must stop it (it is then refused as corrupt and moved aside).
    monkeypatch.delenv("ETTR_CHECKPOINT_SECRET", raising=False)
    root, marker = tmp_path / "ckpt", tmp_path / "pwned"
    _save(root, [1, 2])
    _forge(kind, root / step_dir_name(2), forge.touch_command(marker))
    step, events = _restore(root, allow_unsigned=True)
    assert not marker.exists(), f"the forged checkpoint ({kind}) ran code"
    assert step == 1
    reasons = [e.data["reason"] for e in events if e.data and e.data.get("name") == "checkpoint_skipped"]
    assert reasons, "the forgery was not refused as corrupt"


@pytest.mark.parametrize("kind", FORGERIES)
def test_a_forgery_signed_with_the_jobs_own_key_runs_nothing(tmp_path, kind, monkeypatch):
    # Whoever holds the key (a leaked key, an insider) still cannot make a checkpoint run code.
    from ettr.checkpoint.keys import key_id

    monkeypatch.setenv("ETTR_CHECKPOINT_SECRET", KEY.decode())
    root, marker = tmp_path / "ckpt", tmp_path / "pwned"
    _save(root, [1, 2])
    directory = root / step_dir_name(2)
    _forge(kind, directory, forge.touch_command(marker))
    forge.reseal(directory, secret=KEY, key_id=key_id(KEY))
    if kind in ("bytes-item", "tensor-as-bytes"):
        # A checkpoint signed with the job's own key whose pickled part weights_only refuses is taken for
        # the job's own type missing from safe_globals: the restore stops, saying so, instead of falling
        # back (and retention later deleting what the job needs).
        with pytest.raises(CheckpointError, match="safe_globals"):
            _restore(root)
    else:
        step, _events = _restore(root)
        assert step == 1
    assert not marker.exists(), f"the forged checkpoint ({kind}) ran code"


@pytest.mark.parametrize("kind", FORGERIES)
def test_a_signed_root_restored_without_its_key_runs_nothing(tmp_path, kind, monkeypatch):
    root, marker = tmp_path / "ckpt", tmp_path / "pwned"
    monkeypatch.setenv("ETTR_CHECKPOINT_SECRET", KEY.decode())
    _save(root, [1, 2])
    _forge(kind, root / step_dir_name(2), forge.touch_command(marker))  # unsigned: no key to sign with
    monkeypatch.delenv("ETTR_CHECKPOINT_SECRET")
    step, _events = _restore(root)
    assert not marker.exists(), f"the forged checkpoint ({kind}) ran code"
    assert step == 1


@pytest.mark.parametrize("kind", ["dotted-global", "load-from-bytes", "tensor-as-bytes"])
def test_a_forged_anchor_never_runs_code_as_the_publisher(tmp_path, kind, monkeypatch):
    from test_publish_trust import enqueue_linear, worker

    monkeypatch.delenv("ETTR_CHECKPOINT_SECRET", raising=False)
    marker = tmp_path / "pwned"
    request_id = enqueue_linear(tmp_path)
    _forge(kind, tmp_path / "anchors" / step_dir_name(5), forge.touch_command(marker))
    outcomes = {o.request_id: o for o in worker(tmp_path).drain()}
    assert not marker.exists(), f"the forged anchor ({kind}) ran code in the publisher"
    assert outcomes[request_id].status == "failed"


def test_a_forged_huge_metadata_is_refused_unread(tmp_path, monkeypatch):
    # An unsigned root's `.metadata` was read whole into the rank before it was unpickled, whatever size its
    # (equally forged) manifest gave: a sparse 2 GB one took the rank's peak memory from 0.36 to 2.35 GB. Now
    # one over the bound is refused in one line before it is checksummed or read, and left in place.
    import json
    import zlib

    from ettr.checkpoint.commit import METADATA_MAX_BYTES_ENV, _body_crc

    monkeypatch.delenv("ETTR_CHECKPOINT_SECRET", raising=False)
    monkeypatch.setenv(METADATA_MAX_BYTES_ENV, str(1 << 20))  # the bound, small for the test
    root = tmp_path / "ckpt"
    _save(root, [1, 2])
    directory = root / step_dir_name(2)
    size = (1 << 20) + 1
    with open(directory / ".metadata", "wb") as stream:
        stream.truncate(size)
    manifest = directory / "ettr-manifest.json"
    body = json.loads(manifest.read_bytes())
    for key in ("manifest_crc32", "hmac", "key_id"):
        body.pop(key, None)
    body["files"][".metadata"] = {"size": size, "crc32": zlib.crc32(bytes(size))}
    body["manifest_crc32"] = _body_crc(body)
    manifest.write_text(json.dumps(body))
    step, events = _restore(root, allow_unsigned=True)
    assert step == 1
    refused = [e.data for e in events if e.data and e.data.get("name") == "checkpoint_refused"]
    assert any(f"more than the {1 << 20} ettr reads" in str(data) for data in refused), refused
    assert (directory / ".metadata").stat().st_size == size  # left in place, not moved aside
    monkeypatch.setenv(METADATA_MAX_BYTES_ENV, str(size))  # trusted by the operator: read, then found corrupt
    step, events = _restore(root, allow_unsigned=True)
    assert step == 1 and any("cannot be read" in str(e.data) for e in events if e.data)

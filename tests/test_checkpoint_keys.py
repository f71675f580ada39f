"""Checkpoints are signed by default with a per-user key ring kept outside every root; turning a key on or
changing it keeps earlier checkpoints loadable; a signed root never loads an unsigned checkpoint, or one of a
key the ring lacks, unless asked (issue 25 item 1)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from ettr.checkpoint import CheckpointConfig, CheckpointManager, IntervalConfig, TrainState
from ettr.checkpoint.base import MANIFEST_NAME, step_dir_name
from ettr.checkpoint.keys import KEY_DIR_ENV, SECRET_ENV, KeyRing, key_dir, key_id, new_signing_key
from ettr.ledger import MemoryLedger
from ettr.testing import forge
from ettr.testing.recorder import SyncRecorder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def ring_dir(tmp_path, monkeypatch) -> Path:
    """A fresh key ring of this test's own, and no explicit key."""
    directory = tmp_path / "keys"
    monkeypatch.setenv(KEY_DIR_ENV, str(directory))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv("ETTR_CHECKPOINT_ALLOW_UNSIGNED", raising=False)
    return directory


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _manager(root: Path, rec: SyncRecorder, **kwargs) -> CheckpointManager:
    config = CheckpointConfig(root=root, interval=IntervalConfig(every_steps=1), keep_last=10, **kwargs)
    return CheckpointManager(config, _state(), recorder=rec)


def _save(root: Path, steps: list[int], **kwargs) -> None:
    with _manager(root, SyncRecorder(MemoryLedger()), **kwargs) as manager:
        for step in steps:
            assert manager.save(step, wait=True)


def _restore(root: Path, **kwargs) -> tuple[int | None, dict[str, list[dict]]]:
    rec = SyncRecorder(MemoryLedger())
    with _manager(root, rec, **kwargs) as manager:
        step = manager.restore()
    marks: dict[str, list[dict]] = {}
    for event in rec.events():
        if event.data and "name" in event.data:
            marks.setdefault(event.data["name"], []).append(event.data)
    return step, marks


def _manifest(root: Path, step: int) -> dict:
    return json.loads((root / step_dir_name(step) / MANIFEST_NAME).read_text())


def test_checkpoints_are_signed_by_default_with_a_private_key_outside_the_root(tmp_path, ring_dir):
    root = tmp_path / "ckpt"
    _save(root, [1])
    body = _manifest(root, 1)
    ring = KeyRing.open(create=False)
    assert body["key_id"] == ring.signing_id and body["hmac"]
    assert body["root"] == os.path.realpath(root)
    assert stat.S_IMODE(ring_dir.stat().st_mode) == 0o700
    key_files = list(ring_dir.glob("*.key"))
    assert key_files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in key_files)
    assert not any(p.suffix == ".key" for p in root.rglob("*"))  # nothing of the key in the root
    assert ring.is_signed_root(os.path.realpath(root))


def test_turning_a_key_on_and_changing_it_keeps_earlier_checkpoints(tmp_path, ring_dir, monkeypatch):
    root = tmp_path / "ckpt"
    _save(root, [1])  # the ring's own key
    monkeypatch.setenv(SECRET_ENV, "first explicit key")
    assert _restore(root)[0] == 1  # turning a key on: the earlier checkpoint still verifies
    _save(root, [2])
    assert _manifest(root, 2)["key_id"] == key_id(b"first explicit key")
    monkeypatch.setenv(SECRET_ENV, "second explicit key")  # a rotation
    step, marks = _restore(root)
    assert step == 2 and "checkpoint_refused" not in marks and "checkpoint_skipped" not in marks
    monkeypatch.delenv(SECRET_ENV)  # and off again
    assert _restore(root)[0] == 2


def test_a_new_signing_key_of_the_ring_keeps_the_old_one_verifying(tmp_path, ring_dir):
    root = tmp_path / "ckpt"
    _save(root, [1])
    old = KeyRing.open(create=False).signing_id
    new = new_signing_key()
    assert new != old and KeyRing.open(create=False).signing_id == new
    assert _restore(root)[0] == 1
    _save(root, [2])
    assert _manifest(root, 2)["key_id"] == new


def test_an_unsigned_checkpoint_in_a_signed_root_is_refused_and_left_in_place(
    tmp_path, ring_dir, monkeypatch
):
    root = tmp_path / "ckpt"
    _save(root, [1, 2])
    forge.reseal(root / step_dir_name(2))  # the signature dropped: what a forger without the key writes
    step, marks = _restore(root)
    assert step == 1
    assert "unsigned" in marks["checkpoint_refused"][0]["reason"]
    assert "ETTR_CHECKPOINT_ALLOW_UNSIGNED=1" in marks["checkpoint_refused"][0]["reason"]
    assert (root / step_dir_name(2) / MANIFEST_NAME).exists()  # not moved aside: the user may ask for it
    monkeypatch.setenv("ETTR_CHECKPOINT_ALLOW_UNSIGNED", "1")  # the explicit downgrade
    step, marks = _restore(root)
    assert step == 2 and marks["checkpoint_unauthenticated"]


def test_a_checkpoint_signed_with_a_key_the_ring_lacks_is_refused_until_given(
    tmp_path, ring_dir, monkeypatch
):
    root = tmp_path / "ckpt"
    _save(root, [1, 2])
    other = b"a key this ring never saw"
    forge.reseal(root / step_dir_name(2), secret=other, key_id=key_id(other))
    step, marks = _restore(root)
    assert step == 1 and key_id(other) in marks["checkpoint_refused"][0]["reason"]
    monkeypatch.setenv(SECRET_ENV, other.decode())  # given the key, it verifies
    assert _restore(root)[0] == 2


def test_a_bad_signature_of_a_ring_key_is_a_forgery_and_moved_aside(tmp_path, ring_dir):
    root = tmp_path / "ckpt"
    _save(root, [1, 2])
    mine = KeyRing.open(create=False).signing_id
    forge.reseal(root / step_dir_name(2), secret=b"a guess at the key", key_id=mine)
    step, marks = _restore(root)
    assert step == 1 and "does not verify" in marks["checkpoint_skipped"][0]["reason"]
    assert not (root / step_dir_name(2)).exists()  # moved aside as corrupt


def test_unsigned_checkpoints_of_a_root_never_signed_load_once(tmp_path, ring_dir, monkeypatch):
    # Checkpoints written before ettr signed (simulated: signatures dropped, another ring) are loaded with
    # a warning; the first signed save registers the root, and from then on unsigned is refused.
    root = tmp_path / "ckpt"
    monkeypatch.setenv(KEY_DIR_ENV, str(tmp_path / "an-older-install"))
    _save(root, [1, 2])
    for step in (1, 2):
        forge.reseal(root / step_dir_name(step))
    monkeypatch.setenv(KEY_DIR_ENV, str(ring_dir))
    step, marks = _restore(root)
    assert step == 2 and "never signed" in marks["checkpoint_unauthenticated"][0]["reason"]
    _save(root, [3])
    assert KeyRing.open(create=False).is_signed_root(os.path.realpath(root))
    (root / step_dir_name(3) / MANIFEST_NAME).unlink()  # step 3 lost: step 2 is unsigned in a signed root
    step, marks = _restore(root)
    assert step is None and len(marks["checkpoint_refused"]) == 2


def test_keys_in_a_directory_others_can_write_or_files_others_can_read_are_not_used(tmp_path, ring_dir):
    KeyRing.open(create=True)
    signing = KeyRing.open(create=False).signing_id
    assert signing is not None
    key_file = ring_dir / f"{signing}.key"
    key_file.chmod(0o644)
    assert KeyRing.open(create=False).signing is None  # readable by others: not trusted
    key_file.chmod(0o600)
    ring_dir.chmod(0o770)
    assert KeyRing.open(create=False).keys == {}  # a directory the group may write: nothing in it
    ring_dir.chmod(0o700)
    assert KeyRing.open(create=False).signing_id == signing


def test_a_process_without_any_usable_key_signs_nothing_and_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(KEY_DIR_ENV, str(blocker / "keys"))  # cannot be made
    monkeypatch.delenv(SECRET_ENV, raising=False)
    root = tmp_path / "ckpt"
    _save(root, [1])
    assert "hmac" not in _manifest(root, 1)
    assert _restore(root)[0] == 1


def test_key_dir_defaults_under_the_users_config(monkeypatch):
    assert key_dir({"XDG_CONFIG_HOME": "/cfg"}) == Path("/cfg/ettr/checkpoint-keys")
    assert key_dir({KEY_DIR_ENV: "/k", "XDG_CONFIG_HOME": "/cfg"}) == Path("/k")
    assert key_dir({}) == Path("~/.config/ettr/checkpoint-keys").expanduser()


def test_a_root_whose_name_is_not_utf8_is_signed_and_registered(tmp_path, ring_dir):
    """A root's name is bytes: `\\xff` in it (a surrogate in Python) made the signed-root record raise
    UnicodeEncodeError, so no save there could commit its bookkeeping and no restore could admit."""
    root = tmp_path / os.fsdecode(b"ckpt-\xff")
    _save(root, [1])
    ring = KeyRing.open(create=False)
    assert ring.is_signed_root(os.path.realpath(root))
    assert not ring.is_signed_root(os.path.realpath(tmp_path / "ckpt-\xff"))  # U+00FF is another name


def test_a_secret_that_is_not_utf8_signs_with_its_bytes(tmp_path, ring_dir, monkeypatch):
    """ETTR_CHECKPOINT_SECRET's bytes need not be UTF-8 (`\xff` arrives as a surrogate): `.encode()` raised
    UnicodeEncodeError out of the manager of every rank 0 (the job failed twice before its first step, status
    3). UTF-8 text signs as before; the same compile store secret is read the same way."""
    from ettr.compile.config import CompileConfig

    monkeypatch.setenv(SECRET_ENV, os.fsdecode(b"ab\xff\xfecd"))
    assert KeyRing.open(create=False).signing == b"ab\xff\xfecd"
    _save(tmp_path / "ckpt", [1])
    monkeypatch.setenv(SECRET_ENV, "s\u00e9cret")
    assert KeyRing.open(create=False).signing == "s\u00e9cret".encode()
    config = CompileConfig.from_env({"ETTR_COMPILE_STORE_SECRET": os.fsdecode(b"\xff")})
    assert config is not None and config.secret == b"\xff"


def test_what_a_forged_manifest_says_reaches_the_terminal_escaped(tmp_path, ring_dir, caplog):
    """A manifest's key id and root are quoted in the refusal: whoever can write the root (no key needed:
    an unknown key id is refused in a signed root too) printed an OSC 52 clipboard write and a screen clear
    through the training process's warning."""
    root = tmp_path / "ckpt"
    _save(root, [1, 2])
    forge.reseal(root / step_dir_name(2), secret=b"not-the-key", key_id="k\x1b]52;c;aGk=\x07")
    body = _manifest(root, 1)
    body["root"] = "/x\x1b[2J"
    (root / step_dir_name(1) / MANIFEST_NAME).write_text(json.dumps(body))
    forge.reseal(root / step_dir_name(1), secret=KeyRing.open(create=False).signing)
    step, marks = _restore(root)
    assert step is None and len(marks["checkpoint_refused"]) == 2
    said = caplog.text + json.dumps(marks["checkpoint_refused"], ensure_ascii=False)
    assert "k\\x1b]52;c;aGk=\\x07" in said and "/x\\x1b[2J" in said
    assert "\x1b" not in said and "\x07" not in said

"""The keys checkpoints, anchors and fleet summaries are signed with: a per-user key ring kept outside every
checkpoint root (`ettr.checkpoint.keys` is its checkpoint-side name; this module imports no torch).

The key directory (`ETTR_CHECKPOINT_KEY_DIR`, else `$XDG_CONFIG_HOME/ettr/checkpoint-keys`, else
`~/.config/ettr/checkpoint-keys`) is private to the user (0700; a directory someone else could write, or
a symlink, is not used):

    <key id>.key     one key, 32 random bytes as hex, mode 0600; the id is a digest of the key
    signing          the id of the key new checkpoints are signed with when no key is given explicitly
    roots/<digest>   one file per checkpoint root this user signed a checkpoint in (its path or URL inside)

`KeyRing.open` signs with the explicit key (`CheckpointConfig.secret`, else `ETTR_CHECKPOINT_SECRET`) when
there is one, else with the ring's own key, made on first use. Every key it signs with is kept in the
directory, so turning a key on, or changing it, leaves older checkpoints verifiable; delete a `.key` file
to stop trusting what it signed. The roots registry is how a signed root is told from one that never was
(`admission`): a root an attacker can write cannot tell ettr it was never signed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ettr.atomic import atomic_write, create_exclusive
from ettr.untrusted import open_regular
from ettr.warn import WarnOnce

logger = logging.getLogger("ettr")

KEY_DIR_ENV = "ETTR_CHECKPOINT_KEY_DIR"
"""Where the key ring lives (default `$XDG_CONFIG_HOME/ettr/checkpoint-keys`)."""
SECRET_ENV = "ETTR_CHECKPOINT_SECRET"
"""An explicit key (its bytes as given; UTF-8 text as UTF-8): signs instead of the ring's own key, and is kept in the ring."""

_KEY_SUFFIX = ".key"
_SIGNING = "signing"
_ROOTS = "roots"
_KEY_BYTES = 32
_MAX_KEY_FILE_BYTES = 4096

_warn = WarnOnce("ettr: checkpoint key ring: {what}")


def key_dir(env: Mapping[str, str] | None = None) -> Path:
    """The key ring's directory (see the module docstring)."""
    env = os.environ if env is None else env
    explicit = env.get(KEY_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path("~/.config").expanduser()
    return base / "ettr" / "checkpoint-keys"


def key_id(key: bytes) -> str:
    """The public name of a key: 16 hex digits of a digest (says which key signed, not what it is)."""
    return hashlib.sha256(b"ettr-checkpoint-key\0" + key).hexdigest()[:16]


def root_digest(root: str) -> str:
    """The registry's file name for a checkpoint root (of its bytes: a path that is not UTF-8 is a root too)."""
    return hashlib.sha256(os.fsencode(root)).hexdigest()[:32]


def _private_dir(path: Path) -> bool:
    """Whether `path` is a real directory of this user that nobody else may write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        _warn(f"{path} is not a directory (a symlink?); its keys are not used")
        return False
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        _warn(f"{path} is not private to this user (owner or mode); its keys are not used")
        return False
    return True


def _read_private_file(path: Path) -> bytes | None:
    """A small regular file of this user that nobody else may read or write (never through a symlink)."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as stream:
        st = os.fstat(stream.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > _MAX_KEY_FILE_BYTES:
            return None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            _warn(f"{path} may be read or written by others (chmod 600 it); not used")
            return None
        return stream.read()


@dataclass(frozen=True)
class KeyRing:
    """The keys a process verifies with and the one it signs with (None: it signs nothing).

    Args:
        signing: the key new manifests are signed with.
        keys: every key that verifies, by `key_id`.
        directory: the ring's directory (None: no usable directory: no registry of signed roots).
    """

    signing: bytes | None
    keys: Mapping[str, bytes] = field(default_factory=dict)
    directory: Path | None = None

    @classmethod
    def exact(cls, key: bytes) -> KeyRing:
        """A ring of one key, which signs (no directory, no registry)."""
        return cls(signing=key, keys={key_id(key): key})

    @classmethod
    def open(
        cls, explicit: bytes | None = None, *, create: bool = True, env: Mapping[str, str] | None = None
    ) -> KeyRing:
        """The ring of this user: the keys in `key_dir(env)` plus the explicit key (`explicit`, else
        `ETTR_CHECKPOINT_SECRET`), which signs. Without one, the ring's own signing key signs; with
        `create`, a missing directory or key is made (0700 / 0600) and an explicit key is kept in it.
        Never raises: what cannot be read or made is said once and left out."""
        env = os.environ if env is None else env
        if explicit is None:
            text = env.get(SECRET_ENV, "")
            # its bytes as given: `.encode()` raised UnicodeEncodeError out of every rank's first save for a
            # value that is not UTF-8 (the environment's bytes, as surrogates); UTF-8 text encodes the same
            explicit = os.fsencode(text) if text else None
        wanted = key_dir(env)
        if create and not os.path.lexists(wanted):
            try:
                wanted.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                _warn(f"cannot create {wanted} ({exc}); checkpoints are signed only with an explicit key")
        directory = wanted if _private_dir(wanted) else None
        keys: dict[str, bytes] = {}
        signing_id = ""
        if directory is not None:
            keys = _read_keys(directory)
            signing_id = (_read_private_file(directory / _SIGNING) or b"").decode(errors="replace").strip()
        if explicit is not None:
            keys[key_id(explicit)] = explicit
            if create and directory is not None:
                _keep(directory, explicit)
            return cls(signing=explicit, keys=keys, directory=directory)
        signing = keys.get(signing_id)
        if signing is None and create and directory is not None:
            signing = _make_signing_key(directory)
            if signing is not None:
                keys[key_id(signing)] = signing
        return cls(signing=signing, keys=keys, directory=directory)

    @property
    def signing_id(self) -> str | None:
        """The id of the signing key (None: none)."""
        return key_id(self.signing) if self.signing is not None else None

    def mac(self, key: bytes, canonical: bytes) -> str:
        """The HMAC-SHA256 of `canonical` under `key`, as hex."""
        return hmac.new(key, canonical, hashlib.sha256).hexdigest()

    # -- the registry of signed roots --------------------------------------------------------------------
    def register_root(self, root: str) -> None:
        """Record that a checkpoint was signed in `root` (idempotent; never raises)."""
        if self.directory is None or self.is_signed_root(root):
            return
        try:
            folder = self.directory / _ROOTS
            folder.mkdir(mode=0o700, exist_ok=True)
            create_exclusive(folder / root_digest(root), os.fsencode(root), mode=0o600)
        except OSError as exc:
            _warn(f"cannot record the signed root {root} ({exc})")

    def is_signed_root(self, root: str) -> bool:
        """Whether this user signed a checkpoint in `root` before (the registry says so)."""
        if self.directory is None:
            return False
        return _read_private_file(self.directory / _ROOTS / root_digest(root)) == os.fsencode(root)


def _read_keys(directory: Path) -> dict[str, bytes]:
    keys: dict[str, bytes] = {}
    try:
        names = sorted(p.name for p in directory.iterdir() if p.name.endswith(_KEY_SUFFIX))
    except OSError:
        return keys
    for name in names:
        raw = _read_private_file(directory / name)
        if raw is None:
            continue
        try:
            key = bytes.fromhex(raw.decode().strip())
        except ValueError:
            _warn(f"{directory / name} is not a hex key; not used")
            continue
        if key:
            keys[key_id(key)] = key
    return keys


def _keep(directory: Path, key: bytes) -> None:
    """Store `key` in the ring (so that what it signed stays verifiable after it changes)."""
    path = directory / f"{key_id(key)}{_KEY_SUFFIX}"
    if os.path.lexists(path):
        return
    try:
        create_exclusive(path, key.hex() + "\n", mode=0o600)
    except OSError as exc:
        _warn(f"cannot keep the key {key_id(key)} in {directory} ({exc})")


def _make_signing_key(directory: Path) -> bytes | None:
    """Make the ring's own signing key (two processes racing agree on the first one named `signing`)."""
    key = secrets.token_bytes(_KEY_BYTES)
    try:
        _keep(directory, key)
        if create_exclusive(directory / _SIGNING, key_id(key) + "\n", mode=0o600):
            logger.info("ettr: made checkpoint signing key %s in %s", key_id(key), directory)
            return key
    except OSError as exc:
        _warn(f"cannot make a signing key in {directory} ({exc}); checkpoints are not signed")
        return None
    with contextlib.suppress(OSError):
        os.remove(directory / f"{key_id(key)}{_KEY_SUFFIX}")  # another process made one first
    winner = (_read_private_file(directory / _SIGNING) or b"").decode(errors="replace").strip()
    return _read_keys(directory).get(winner)


def new_signing_key(directory: Path | None = None) -> str:
    """Make a new signing key for the ring (older keys keep verifying what they signed); returns its id.
    Raises OSError when the directory cannot be written."""
    directory = directory or key_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private_dir(directory):
        raise PermissionError(f"{directory} is not a private directory of this user")
    key = secrets.token_bytes(_KEY_BYTES)
    _keep(directory, key)
    atomic_write(directory / _SIGNING, key_id(key) + "\n", mode=0o600)
    return key_id(key)

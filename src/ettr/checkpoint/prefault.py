"""Pages made ahead: a mapping's memory allocated and mapped before a copy into it, off the loop's path.

A copy into memory never touched stops at every page for the kernel to allocate, zero and map it: a
staging copy of 40 MB into fresh pages took ~18 ms of CPU here, ~5 into pages already mapped.
`populate` has Linux do that work for a whole range at once (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14
and later: the pages are faulted in as a write would, and nothing is written, so the bytes stay as they
are), from whatever thread calls it; ctypes releases the GIL for the call, so a background thread doing
it does not hold up the training loop's Python. Where the kernel lacks it, nothing is done and the copy
faults the pages in as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
from typing import Any

logger = logging.getLogger("ettr")

MADV_POPULATE_WRITE = 23
"""Linux's `madvise` advice that faults a range in writable (include/uapi/asm-generic/mman-common.h)."""


@functools.cache
def _madvise() -> Any:
    """libc's `madvise`, resolved once (None where there is none)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def populate(address: int, nbytes: int) -> bool:
    """Fault in the pages of [address, address + nbytes) writable, writing nothing; `address` must start a
    page. Returns whether the kernel did it (False: unsupported or refused; the pages then fault in as they
    are first written, as without this). Never raises."""
    madvise = _madvise()
    if madvise is None or nbytes <= 0 or address % mmap.PAGESIZE:
        return False
    if madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return True
    logger.debug(
        "ettr: MADV_POPULATE_WRITE failed (errno %d); pages fault in at the copy", ctypes.get_errno()
    )
    return False


def populate_mapping(mapped: mmap.mmap) -> bool:
    """`populate` over the whole of a writable `mmap.mmap`."""
    if mapped.closed or not len(mapped):
        return False
    holder = ctypes.c_char.from_buffer(mapped)  # exports the buffer: let go at once (close needs none left)
    address = ctypes.addressof(holder)
    del holder
    return populate(address, len(mapped))

"""prefault: pages faulted in ahead of a copy, nothing written (docs/checkpointing.md, "A save's blocking part")."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from ettr.checkpoint import prefault


def test_populate_writes_nothing_and_refuses_what_it_cannot_do() -> None:
    mapped = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    mapped[:5] = b"hello"
    done = prefault.populate_mapping(mapped)
    assert bytes(mapped[:5]) == b"hello" and bytes(mapped[5:]) == bytes(4 * mmap.PAGESIZE - 5)
    if sys.platform == "linux":
        assert isinstance(done, bool)  # False on a kernel older than 5.14, where pages fault in at the copy
    tensor = torch.frombuffer(mapped, dtype=torch.uint8)
    assert not prefault.populate(int(tensor.data_ptr()) + 1, 16)  # not the start of a page
    assert not prefault.populate(int(tensor.data_ptr()), 0)
    del tensor
    mapped.close()  # no buffer export left behind
    assert not prefault.populate_mapping(mapped)


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_a_shared_file_mapping_is_populated(tmp_path) -> None:
    path = tmp_path / "slot"
    path.write_bytes(b"x" * mmap.PAGESIZE + bytes(3 * mmap.PAGESIZE))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        prefault.populate_mapping(mapped)
        assert mapped[: mmap.PAGESIZE] == b"x" * mmap.PAGESIZE
    assert path.read_bytes()[: mmap.PAGESIZE] == b"x" * mmap.PAGESIZE

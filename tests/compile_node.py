"""Shared by the compile store tests: a store backend that counts its reads, and a "node" (inductor's cache and
precompiled-header directories under a test's tmp_path, switched by name) as a fixture body."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ettr.compile import artifacts
from ettr.compile.backend import MemoryBackend


class CountingBackend(MemoryBackend):
    """A memory store backend that keeps the paths it was asked to read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def read(self, path: str) -> bytes:
        self.reads.append(path)
        return super().read(path)


def node_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str], tuple[Path, Path]]]:
    """A fixture's body: inductor's cache and header directories under `tmp_path/<name>`, switched by
    `use(name)`, precompiled headers counted as used (as after C++ kernels), under a fixed compile job id."""
    current: dict[str, Path] = {}

    def use(name: str) -> tuple[Path, Path]:
        current["cache"], current["headers"] = tmp_path / name / "inductor", tmp_path / name / "headers"
        return current["cache"], current["headers"]

    monkeypatch.setattr(artifacts, "inductor_cache_dir", lambda: current["cache"])
    monkeypatch.setattr(artifacts, "headers_dir", lambda: current["headers"])
    monkeypatch.setattr(artifacts, "used_precompiled_headers", lambda: True)
    with torch.compiler.config.patch(job_id="test-job"):
        yield use

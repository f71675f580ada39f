"""Names to show for run directories: short, and different wherever the directories differ."""

from __future__ import annotations

import os
from collections.abc import Sequence


def run_labels(run_dirs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Each run directory's last path component, with as many parent components as it takes to tell apart
    directories that share it (`runs/a/job`, `runs/b/job` -> `a/job`, `b/job`). The same directory given
    twice keeps one label twice (renderers that need unique names add a suffix)."""
    parts = [os.path.abspath(os.fspath(d)).strip(os.sep).split(os.sep) for d in run_dirs]
    depth = [1] * len(parts)
    while True:
        labels = ["/".join(p[-n:]) or "/" for p, n in zip(parts, depth, strict=True)]
        grown = False
        for i, label in enumerate(labels):
            clash = any(j != i and labels[j] == label and parts[j] != parts[i] for j in range(len(labels)))
            if clash and depth[i] < len(parts[i]):
                depth[i] += 1
                grown = True
        if not grown:
            return labels

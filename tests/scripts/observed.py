"""What a framework test script saw of its own run, appended as JSON lines (one write per fact, so that a
crash keeps everything written before it); `read_truth` turns the lines back into per-attempt facts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class Observed:
    """Appends {"attempt", "what", "step", "t0", "t1"} lines to `path` (nothing when `path` is None)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.attempt = int(os.environ.get("ETTR_ATTEMPT", "0"))

    def write(
        self, what: str, step: int | None = None, t0: float | None = None, t1: float | None = None
    ) -> None:
        if self.path is None:
            return
        line = {"attempt": self.attempt, "what": what, "step": step, "t0": t0, "t1": t1 or time.time()}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_truth(path: Path) -> dict[int, dict[str, Any]]:
    """attempt -> {"resumed": step|None, "steps": [(step, t0, t1)], "checkpoints": sorted distinct steps}."""
    attempts: dict[int, dict[str, Any]] = {}
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        a = attempts.setdefault(line["attempt"], {"resumed": None, "steps": [], "checkpoints": set()})
        if line["what"] == "resumed":
            a["resumed"] = line["step"]
        elif line["what"] == "step":
            a["steps"].append((line["step"], line["t0"], line["t1"]))
        elif line["what"] == "checkpoint":
            a["checkpoints"].add(line["step"])
    for a in attempts.values():
        a["checkpoints"] = sorted(a["checkpoints"])
    return attempts

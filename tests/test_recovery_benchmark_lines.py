"""What `benchmarks/recovery.py` says of a failed trial: the last exception its stderr reports, not torchrun's
closing pointer to its docs, and without the source paths gloo puts in its messages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _recovery():
    spec = importlib.util.spec_from_file_location("recovery_benchmark", ROOT / "benchmarks" / "recovery.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_trial_says_its_last_error_without_gloos_source_paths(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    stderr.write_text(
        "[rank1]: Traceback (most recent call last):\n"
        "[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:144] "
        "Gloo connectFullMesh failed with timed out connecting: SO_ERROR: Connection refused\n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
        "============================================================\n"
    )
    said = _recovery()._last_error(stderr)
    assert (
        said
        == "RuntimeError: Gloo connectFullMesh failed with timed out connecting: SO_ERROR: Connection refused"
    )


def test_without_an_exception_line_the_last_line_is_said(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    stderr.write_text("starting\nworker exited 1\n=====\n")
    assert _recovery()._last_error(stderr) == "worker exited 1"
    assert _recovery()._last_error(tmp_path / "missing.log") == ""

"""The docs' runnable code blocks run as written: every ```python block right after a `<!-- test: run -->`
line in README.md or docs/*.md is executed in a fresh interpreter in an empty directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"<!-- test: run -->\n```python\n(.*?)```", re.DOTALL)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, match in enumerate(_BLOCK.finditer(page.read_text()), 1):
            found.append((f"{page.relative_to(ROOT)}#{number}", match.group(1)))
    return found


def test_the_docs_have_runnable_examples() -> None:
    assert any(name.startswith("README.md") for name, _ in _blocks())


@pytest.mark.slow
@pytest.mark.parametrize("name, code", _blocks(), ids=[name for name, _ in _blocks()])
def test_doc_example_runs_as_written(tmp_path: Path, name: str, code: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{name}:\n{done.stderr[-3000:]}"

"""The import arrows point one way (docs/architecture.md): checked on the source with `ast`, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "ettr"

# package (or module) -> the ettr packages it must never import, at any depth of the file or function.
FORBIDDEN = {
    "bootstrap": ("ettr.supervisor", "ettr.cli"),
    "report": ("ettr.supervisor", "ettr.cli"),
    "checkpoint": ("ettr.supervisor", "ettr.cli"),
    "compile": ("ettr.supervisor", "ettr.cli"),
    "fleet": ("ettr.supervisor", "ettr.cli", "ettr.recorder", "ettr.runtime"),
    "simulate": ("ettr.supervisor", "ettr.cli", "ettr.recorder", "ettr.runtime", "ettr.fleet"),
    "accounting": ("ettr.supervisor", "ettr.cli", "ettr.report", "ettr.recorder", "ettr.runtime"),
    "events": ("ettr.",),
    "run_env": ("ettr.",),
    "procs": ("ettr.",),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports (absolute names; relative imports resolved), with its line."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def _files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "pythonpath" not in p.parts)


def _violations(path: Path) -> list[str]:
    rel = path.relative_to(SRC)
    top = rel.parts[0].removesuffix(".py")
    banned = ("ettr.cli",) + FORBIDDEN.get(top, ())
    out: dict[int, str] = {}  # one per import statement
    for line, name in _imports(path):
        for prefix in banned:
            if prefix.endswith("."):
                hit = name.startswith(prefix)
            else:
                hit = name == prefix or name.startswith(prefix + ".")
            if hit and top not in ("cli", "__main__"):  # `python -m ettr` is the CLI's other front door
                out.setdefault(line, f"{rel}:{line} imports {name}")
    return list(out.values())


def test_the_source_tree_is_where_the_test_expects_it():
    assert (SRC / "cli.py").is_file() and len(_files()) > 50


def test_nothing_imports_the_cli_and_the_arrows_point_one_way():
    problems = [v for path in _files() for v in _violations(path)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        ("report/x.py", "from ettr.supervisor.books import live_supervisor\n", 1),
        ("report/x.py", "def f():\n    from ..supervisor import books\n", 1),
        ("bootstrap/x.py", "import ettr.supervisor.process\n", 1),
        ("publish/x.py", "from ettr import cli\n", 1),
        ("run_env.py", "from ettr.events import Event\n", 1),
        ("report/x.py", "from ettr.closing import live_supervisor\n", 0),
        ("supervisor/x.py", "from ettr.report.load import read_run\n", 0),
    ],
)
def test_the_check_catches_what_it_should(tmp_path, monkeypatch, rel, source, expected):
    fake = tmp_path / "ettr"
    path = fake / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    monkeypatch.setitem(globals(), "SRC", fake)
    assert len(_violations(path)) == expected

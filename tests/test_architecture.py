"""The import arrows are the ones docs/architecture.md draws: its table "Which imports may go which way" is read
here as an allow-list and every import of `src/ettr` is checked against it, with `ast` (nothing imported).

Fails on an import the table does not allow, on a part of `src/ettr` the table does not name, and on a cycle
between parts. Planted violations (a fake source tree, a fake table) show that each check can fail.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "ettr"
DOC = ROOT / "docs" / "architecture.md"

FACADE = "ettr"  # the package's __init__.py: the users' front door
APPS = ("cli", "__main__", "demo", "testing")  # not library: `anything` leaves them out


# -- the table -----------------------------------------------------------------------------------------------
def read_table(text: str) -> dict[str, tuple[str, ...]]:
    """`docs/architecture.md`'s import table: part -> what it may import, as written (`leaves`, `anything`,
    `nothing` not yet expanded). Raises ValueError for a table it cannot read."""
    found = re.search(r"## Which imports may go which way\n.*?```\n(.*?)```", text, re.S)
    if found is None:
        raise ValueError("docs/architecture.md has no import table (## Which imports may go which way)")
    table: dict[str, tuple[str, ...]] = {}
    pending = ""
    for raw in found.group(1).splitlines():
        line = re.sub(r"\s\s+\(.*$|\s+\([^)]*\)\s*$", "", raw).rstrip()  # comments: text in parentheses
        pending = f"{pending} {line.strip()}" if pending else line
        if pending.endswith(","):
            continue  # the line goes on
        if pending.strip():
            if "<-" not in pending:
                raise ValueError(f"import table: no '<-' in {raw!r}")
            left, right = pending.split("<-", 1)
            targets = tuple(t.strip() for t in right.split(",") if t.strip())
            for part in (p.strip() for p in left.split(",")):
                if part in table:
                    raise ValueError(f"import table: {part} has two lines")
                table[part] = targets
        pending = ""
    return table


def expand(table: Mapping[str, tuple[str, ...]]) -> dict[str, frozenset[str]]:
    """The table with `leaves` (the first line's parts), `anything` (every library part) and `nothing`
    spelled out."""
    leaves = [part for part, targets in table.items() if targets == ("nothing",)]
    library = [part for part in table if part not in APPS]
    out: dict[str, frozenset[str]] = {}
    for part, targets in table.items():
        names: set[str] = set()
        for target in targets:
            if target == "leaves":
                names.update(leaves)
            elif target == "anything":
                names.update(library)
            elif target != "nothing":
                names.add(target)
        out[part] = frozenset(names)
    return out


def allowed_table() -> dict[str, frozenset[str]]:
    return expand(read_table(DOC.read_text(encoding="utf-8")))


# -- the source ----------------------------------------------------------------------------------------------
def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, src: Path) -> list[tuple[int, str]]:
    """Every name `path` imports (absolute, relative ones resolved; `from M import N` gives `M.N`), with its
    line, at any depth of the file (inside functions and `TYPE_CHECKING` too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path, src).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
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
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def _part_of(path: Path, src: Path) -> str:
    rel = path.relative_to(src)
    return FACADE if rel.parts == ("__init__.py",) else rel.parts[0].removesuffix(".py")


def _parts(src: Path) -> set[str]:
    """The parts of the package: its top-level modules and packages, and the facade."""
    return {_part_of(p, src) for p in _files(src)}


def _target(name: str, parts: Iterable[str]) -> tuple[str, str] | None:
    """The part an imported `name` is in and the name inside the package (None: not ettr)."""
    if name == "ettr":
        return FACADE, ""
    if not name.startswith("ettr."):
        return None
    inner = name.removeprefix("ettr.")
    head = inner.split(".", 1)[0]
    return (head, inner) if head in parts else (FACADE, inner)


def _files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*.py") if "pythonpath" not in p.parts and "_examples" not in p.parts)


def violations(src: Path, allowed: Mapping[str, frozenset[str]]) -> list[str]:
    """Every import of the tree at `src` that `allowed` does not allow, and every part it does not name."""
    parts = _parts(src)
    problems = [
        f"{part}: a part of src/ettr that docs/architecture.md's import table does not name (add its line)"
        for part in sorted(parts - allowed.keys())
    ]
    for path in _files(src):
        part = _part_of(path, src)
        if part not in allowed:
            continue
        seen: set[int] = set()
        for line, name in _imports(path, src):
            found = _target(name, parts)
            if found is None or found[0] == part or line in seen:
                continue
            target, inner = found
            ok = any(
                inner == a or inner.startswith(a + ".") or (a == target == FACADE) for a in allowed[part]
            )
            if not ok:
                seen.add(line)
                problems.append(
                    f"{path.relative_to(src)}:{line} imports {name}: `{part} <- {target}` is not in "
                    "docs/architecture.md's import table"
                )
    return problems


def graph(src: Path) -> dict[str, set[str]]:
    """part -> the other parts it imports."""
    parts = _parts(src)
    edges: dict[str, set[str]] = {part: set() for part in parts}
    for path in _files(src):
        part = _part_of(path, src)
        for _, name in _imports(path, src):
            found = _target(name, parts)
            if found is not None and found[0] != part:
                edges[part].add(found[0])
    return edges


def cycle(edges: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of `edges` (its parts in order, the first repeated last), None when there is none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


# -- the checks ----------------------------------------------------------------------------------------------
def test_the_source_tree_and_the_table_are_where_the_test_expects_them():
    assert (SRC / "cli.py").is_file() and len(_files(SRC)) > 50
    table = allowed_table()
    assert {"events", "ledger", "supervisor", "report", "cli", FACADE} <= table.keys()
    assert (
        table["events"] == frozenset() and "cli" not in table["demo"] and "supervisor" not in table["report"]
    )


def test_every_import_is_one_the_architecture_page_allows():
    problems = violations(SRC, allowed_table())
    assert problems == [], "\n".join(problems)


def test_the_allowed_arrows_and_the_real_ones_have_no_cycle():
    table = allowed_table()
    # `anything` names the library: an app or harness may use it all, so leave the apps out of the search
    library = {
        part: {t.split(".")[0] for t in targets} for part, targets in table.items() if part not in APPS
    }
    assert cycle(library) is None, f"the import table has a cycle: {' -> '.join(cycle(library) or [])}"
    real = graph(SRC)
    assert cycle(real) is None, f"the imports have a cycle: {' -> '.join(cycle(real) or [])}"


def test_nothing_in_the_library_imports_an_app_or_a_harness():
    table = allowed_table()
    for part, targets in table.items():
        if part not in APPS:
            assert not {t.split(".")[0] for t in targets} & {"cli", "demo", "testing"}, part


MAX_SUPERVISOR_LINES = 400
"""issue 23: the supervisor in small parts, one concept per file; a file that grows past this is split."""


def test_no_file_of_the_supervisor_is_over_400_lines():
    sizes = {
        p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in (SRC / "supervisor").glob("*.py")
    }
    long = {name: n for name, n in sizes.items() if n > MAX_SUPERVISOR_LINES}
    assert not long, f"split by concept (docs/architecture.md, supervisor/): {long}"


# -- the checks can fail ---------------------------------------------------------------------------------------
TABLE = """## Which imports may go which way
```
events, run_env <- nothing
ledger        <- leaves      (a comment)
report        <- leaves, ledger,
                 audit.MARK_NAME   (goes on)
audit         <- leaves
supervisor    <- leaves, ledger, bootstrap.pythonpath_dir
bootstrap     <- leaves
ettr          <- leaves
testing       <- anything
cli           <- anything
```
"""


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    src = tmp_path / "ettr"
    base = {
        "__init__.py": "",
        "events.py": "",
        "run_env.py": "",
        "ledger/__init__.py": "from ettr.events import Event\n",
        "report/__init__.py": "from ..ledger import open_ledger\nfrom ettr.audit import MARK_NAME\n",
        "audit.py": "",
        "supervisor/__init__.py": "from ettr.bootstrap import pythonpath_dir\n",
        "bootstrap/__init__.py": "",
        "testing/__init__.py": "import ettr.supervisor\nimport ettr\n",
        "cli.py": "from ettr import supervisor\n",
    }
    for rel, source in {**base, **files}.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return src


def test_the_table_reads_as_written():
    table = read_table(TABLE)
    assert table["report"] == ("leaves", "ledger", "audit.MARK_NAME")
    assert table["events"] == table["run_env"] == ("nothing",)
    allowed = expand(table)
    assert allowed["ledger"] == {"events", "run_env"}
    assert "cli" not in allowed["testing"] and "testing" not in allowed["cli"] and "ettr" in allowed["cli"]


def test_a_tree_that_keeps_to_the_table_passes(tmp_path):
    assert violations(_tree(tmp_path, {}), expand(read_table(TABLE))) == []


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        ("report/x.py", "from ettr.supervisor.books import live_supervisor\n", "`report <- supervisor`"),
        ("report/x.py", "def f():\n    from ..supervisor import books\n", "`report <- supervisor`"),
        ("bootstrap/x.py", "import ettr.supervisor.process\n", "`bootstrap <- supervisor`"),
        ("ledger/x.py", "from ettr import cli\n", "`ledger <- cli`"),
        ("run_env.py", "from ettr.events import Event\n", "`run_env <- events`"),
        ("report/x.py", "from ettr.audit import record_audit\n", "`report <- audit`"),  # one name only
        ("supervisor/x.py", "from ettr.bootstrap.start import main\n", "`supervisor <- bootstrap`"),
        ("ledger/x.py", "import ettr\n", "`ledger <- ettr`"),  # the facade is for users
        ("ledger/x.py", "from ettr import get_recorder\n", "`ledger <- ettr`"),
        (
            "ledger/x.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ettr.report import x\n",
            "`ledger <- report`",
        ),
        ("fleet.py", "", "fleet: a part of src/ettr that docs/architecture.md's import table does not name"),
    ],
)
def test_a_planted_violation_fails(tmp_path, rel, source, expected):
    problems = violations(_tree(tmp_path, {rel: source}), expand(read_table(TABLE)))
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_planted_cycle_is_found(tmp_path):
    src = _tree(tmp_path, {"ledger/x.py": "from ettr.report import y\n"})
    assert cycle(graph(src)) == ["ledger", "report", "ledger"]
    assert cycle({"a": ["b"], "b": ["c"], "c": []}) is None


def test_a_table_that_cannot_be_read_says_so():
    with pytest.raises(ValueError, match="no import table"):
        read_table("# nothing here\n")
    with pytest.raises(ValueError, match="no '<-'"):
        read_table("## Which imports may go which way\n```\nledger events\n```\n")
    with pytest.raises(ValueError, match="two lines"):
        read_table("## Which imports may go which way\n```\na <- b\na <- c\n```\n")

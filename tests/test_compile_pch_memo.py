"""Inductor's precompiled-header lookup, remembered (`ettr.compile.pch_memo`), with a fake lookup: a process
whose call and key match an earlier one's, and which has the header and its `.gch`, skips the preprocessing;
anything else runs it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from ettr.compile import pch_memo
from ettr.patcher import Patcher

HEADER = "torch/csrc/inductor/cpp_prefix.h"


@pytest.fixture(autouse=True)
def _forget_used_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The headers a test's lookups answer are this test's, not the process's (`pch_memo.used_headers`)."""
    monkeypatch.setattr(pch_memo, "_answered", set())


class FakeLookup:
    """`_precompile_header` as inductor has it: cached per call, writes `<hash>.h` and its `.gch`."""

    def __init__(self, header_dir: Path, *, gch: bool = True) -> None:
        self.header_dir, self.gch, self.calls = header_dir, gch, 0
        self.lookup = functools.cache(self._run)

    def _run(self, header: str, cmd_line: str, **compile_command: Any) -> str:
        self.calls += 1  # the preprocessing (`g++ -E`, `openssl sha512`)
        path = self.header_dir / "cabcdef.h"  # as inductor names it: `<hash>.h` in its header directory
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#include <{header}>\n")
        if self.gch:
            Path(f"{path}.gch").write_bytes(b"pch")
        return str(path)


def _wrapped(tmp_path: Path, lookup: FakeLookup, key: dict[str, str] | None = None) -> Any:
    dirs = (tmp_path / "cache", tmp_path / "headers")
    dirs[0].mkdir(exist_ok=True)
    return pch_memo.remembered(lookup.lookup, lambda: dirs, key=lambda header: key or {"torch": "2.x"})


def test_a_later_process_takes_the_remembered_header_without_preprocessing(tmp_path: Path) -> None:
    first = FakeLookup(tmp_path / "headers")
    path = _wrapped(tmp_path, first)(HEADER, "g++ -O3", vec_isa="avx2")
    assert first.calls == 1 and (tmp_path / "cache" / pch_memo.MEMO_NAME).is_file()
    later = FakeLookup(tmp_path / "headers")  # a new process: inductor's cache is empty
    wrapped = _wrapped(tmp_path, later)
    assert wrapped(HEADER, "g++ -O3", vec_isa="avx2") == path
    assert wrapped(HEADER, "g++ -O3", vec_isa="avx2") == path
    assert later.calls == 0
    # the compile store still sees that this process used a precompiled header
    assert wrapped.cache_info().currsize == 1


@pytest.mark.parametrize(
    "change",
    ["key", "cmd_line", "no_gch", "escaping_path", "not_a_header", "below", "damaged_memo"],
)
def test_anything_not_the_same_runs_the_lookup(tmp_path: Path, change: str) -> None:
    _wrapped(tmp_path, FakeLookup(tmp_path / "headers"))(HEADER, "g++ -O3", vec_isa="avx2")
    memo = tmp_path / "cache" / pch_memo.MEMO_NAME
    key, cmd_line = None, "g++ -O3"
    if change == "key":
        key = {"torch": "2.y"}  # another torch, compiler, libtorch or header file
    elif change == "cmd_line":
        cmd_line = "g++ -O2"
    elif change == "no_gch":
        (tmp_path / "headers" / "cabcdef.h.gch").unlink()
    elif change == "escaping_path":
        outside = tmp_path / "evil.h"
        outside.write_text("")
        Path(f"{outside}.gch").write_bytes(b"")
        data = json.loads(memo.read_text())
        data["entries"][0]["header"] = "../evil.h"
        memo.write_text(json.dumps(data))
    elif change in ("not_a_header", "below"):  # files inside the directory, each with a `.gch` beside it,
        # that inductor never names a header: what a forged memo names, g++ is told to -include
        name = "kernel.so" if change == "not_a_header" else "sub/x.h"
        (tmp_path / "headers" / name).parent.mkdir(exist_ok=True)
        for file in (name, f"{name}.gch"):
            (tmp_path / "headers" / file).write_bytes(b"")
        data = json.loads(memo.read_text())
        data["entries"][0]["header"] = name
        memo.write_text(json.dumps(data))
    else:
        memo.write_text("{not json")
    later = FakeLookup(tmp_path / "headers")
    path = _wrapped(tmp_path, later, key)(HEADER, cmd_line, vec_isa="avx2")
    assert later.calls == 1 and path == str(tmp_path / "headers" / "cabcdef.h")


def test_a_header_without_its_compiled_form_is_not_remembered(tmp_path: Path) -> None:
    _wrapped(tmp_path, FakeLookup(tmp_path / "headers", gch=False))(HEADER, "g++ -O3")
    assert not (tmp_path / "cache" / pch_memo.MEMO_NAME).exists()


def test_no_key_no_memo(tmp_path: Path) -> None:
    lookup = FakeLookup(tmp_path / "headers")
    dirs = (tmp_path / "cache", tmp_path / "headers")
    wrapped = pch_memo.remembered(lookup.lookup, lambda: dirs, key=lambda header: None)  # not torch's header
    wrapped(HEADER, "g++ -O3")
    assert lookup.calls == 1 and not (tmp_path / "cache" / pch_memo.MEMO_NAME).exists()


def test_the_call_is_the_same_text_in_every_process() -> None:
    class Isa:  # inductor's VecISA: a repr naming a function's address, a str naming the ISA
        def __repr__(self) -> str:
            return f"Isa(__hash__=<function at {id(self):#x}>)"

        def __str__(self) -> str:
            return "avx512"

    assert pch_memo._stable(Isa()) == pch_memo._stable(Isa())
    assert pch_memo._stable(("a", 1)) == "tuple('a', 1)"


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pch_memo.MEMO_ENV, "0")
    assert not pch_memo.share(Patcher())


def test_it_wraps_inductors_lookup_and_keeps_its_cache_info(monkeypatch: pytest.MonkeyPatch) -> None:
    codecache = pytest.importorskip("torch._inductor.codecache")
    from ettr import torch_compat
    from ettr.patcher import ORIGINAL_ATTR

    original = getattr(codecache._precompile_header, ORIGINAL_ATTR, None)
    if original is not None:  # wrapped by a compile session an earlier test of this process started
        monkeypatch.setattr(codecache, "_precompile_header", original)

    patcher = Patcher()
    try:
        assert pch_memo.share(patcher)
        assert torch_compat.inductor_used_precompiled_header() in (True, False)  # read through the wrapper
        assert not pch_memo.share(patcher)  # ours already
    finally:
        patcher.undo()


def test_the_headers_a_process_was_given_are_its_used_headers(tmp_path: Path) -> None:
    assert pch_memo.used_headers() == frozenset()
    _wrapped(tmp_path, FakeLookup(tmp_path / "headers"))(HEADER, "g++ -O3")  # looked up
    later = _wrapped(tmp_path, FakeLookup(tmp_path / "headers"))
    later(HEADER, "g++ -O3")  # recalled
    assert pch_memo.used_headers() == {"cabcdef.h"}

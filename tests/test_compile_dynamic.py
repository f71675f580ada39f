"""Learned dynamic sources: from guard-failure reasons, merged, kept per job, applied to torch's config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ettr.compile import dynamic
from ettr.compile.dynamic import DynamicSource
from ettr.compile.session import STORE_MARK
from ettr.compile.summary import summarize
from ettr.events import Event, EventKind, Phase
from ettr.report.compile_text import render


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (
            "0/0: tensor 'args[0]' size mismatch at index 0. expected 4, actual 6",
            [DynamicSource("L['args'][0]", 0)],
        ),
        ("0/3: tensor 'x' size mismatch at index 1. expected 8, actual 16", [DynamicSource("L['x']", 1)]),
        ("tensor 'L['x']' size mismatch at index 2. expected 1, actual 2", [DynamicSource("L['x']", 2)]),
        ("0/1: 2 <= args[0].size()[0] <= 4096  # ...", []),
        ("0/0: ___check_obj_id(L['self'], 1234)", []),
    ],
)
def test_reasons_name_the_dimension_that_changed(reason, expected):
    assert dynamic.from_reason(reason) == expected


def test_render_and_parse_are_inverse_and_merge_dedupes():
    sources = [DynamicSource("L['x']", 0), DynamicSource("L['n']"), DynamicSource("L['x']", 0)]
    merged = dynamic.merge(sources)
    assert merged == (DynamicSource("L['n']"), DynamicSource("L['x']", 0))
    assert dynamic.render(merged) == "L['n'],L['x']:0"
    assert dynamic.parse_many(dynamic.render(merged).split(",")) == merged
    # An all-dimensions entry covers the per-dimension entries of its source.
    assert dynamic.merge([DynamicSource("L['x']", 1), DynamicSource("L['x']")]) == (DynamicSource("L['x']"),)
    assert dynamic.parse_many(["", "L['y']:3"]) == (DynamicSource("L['y']", 3),)


def test_the_job_file_merges_across_attempts_and_survives_corruption(tmp_path):
    path = dynamic.job_file(tmp_path)
    assert dynamic.load(path) == ((), [])
    dynamic.save(path, [DynamicSource("L['x']", 0)], [{"reason": "r1", "attempt": 0}])
    merged = dynamic.save(path, [DynamicSource("L['y']", 1)], [{"reason": "r2", "attempt": 1}])
    assert merged == (DynamicSource("L['x']", 0), DynamicSource("L['y']", 1))
    sources, reasons = dynamic.load(path)
    assert sources == merged and [r["reason"] for r in reasons] == ["r1", "r2"]
    assert json.loads(path.read_text())["env"] == "L['x']:0,L['y']:1"
    path.write_text("{broken")
    assert dynamic.load(path) == ((), [])


@pytest.mark.parametrize(
    "forged",
    [
        "[" * 100_000,  # nested past the recursion limit
        '{"schema": "ettr.compile-dynamic/1", "sources": 5, "reasons": 7}',
        '{"schema": "ettr.compile-dynamic/1", "sources": [' + '"x",' * (2 << 20) + '"x"]}',  # too large
        "[]",
    ],
)
def test_a_forged_job_file_is_read_as_nothing_learned(tmp_path, forged):
    path = dynamic.job_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(forged)
    assert dynamic.load(path) == ((), [])


def test_apply_keeps_the_users_own_entries():
    torch = pytest.importorskip("torch")
    with torch.compiler.config.patch(dynamic_sources="L\\['user.*'\\]"):
        value = dynamic.apply([DynamicSource("L['x']", 0), DynamicSource("L['x']", 0)])
        assert value == "L\\['user.*'\\],L['x']:0"
        assert torch.compiler.config.dynamic_sources == value
        assert dynamic.apply([DynamicSource("L['x']", 0)]) == value


def test_compile_report_summarizes_spans_recompiles_and_store_actions():
    events = [
        Event(EventKind.PHASE_END, 12.0, 0, 0, Phase.COMPILE, value=2.0, data={"source": "dynamo"}),
        Event(EventKind.RECOMPILE, 20.0, 0, 0, data={"reason": "tensor 'x' size mismatch at index 0"}),
        Event(EventKind.PHASE_END, 23.0, 0, 0, Phase.COMPILE, value=20.0, data={"source": "dynamo"}),
        Event(EventKind.MARK, 1.0, 0, 0, data={"name": STORE_MARK, "action": "restore", "status": "miss"}),
        Event(EventKind.PHASE_END, 9.0, 1, 0, Phase.COMPILE, value=8.0, data={"source": "dynamo"}),
        Event(EventKind.PHASE_END, 9.0, 1, 0, Phase.COMPILE, value=5.0, data={"source": "fast_start"}),
        Event(EventKind.PHASE_END, 9.0, 1, 0, Phase.DATA_WAIT, value=5.0),
    ]
    summary = summarize(events, learned=((DynamicSource("L['x']", 0),), [{"reason": "r"}]))
    first, second = summary["attempts"]
    assert (first["num_compiles"], first["compile_s"], first["num_recompiles"]) == (2, 13.0, 1)
    assert first["store"][0]["status"] == "miss"
    assert (second["num_compiles"], second["num_recompiles"], second["fast_start_compile_s"]) == (1, 0, 4.0)
    assert summary["torch_compile_dynamic_sources"] == "L['x']:0"
    text = render(summary)
    assert "1 x tensor 'x' size mismatch at index 0" in text
    assert "TORCH_COMPILE_DYNAMIC_SOURCES=\"L['x']:0\"" in text
    assert "restore miss" in text


def test_the_pgo_profile_yields_only_dimensions_and_scalars_that_varied(monkeypatch):
    pytest.importorskip("torch")
    from collections import defaultdict

    from torch._dynamo import pgo

    state = pgo.CodeState()
    state.automatic_dynamic["L['x']"] = pgo.FrameStateSizeEntry.make_tensor((8, 3), (3, 1))
    state.automatic_dynamic["L['x']"] |= pgo.FrameStateSizeEntry.make_tensor((16, 3), (3, 1))
    state.automatic_dynamic["L['self'].eps"] = pgo.FrameStateSizeEntry.make_scalar(5)  # a constant
    state.automatic_dynamic["L['n']"] = pgo.FrameStateSizeEntry.make_scalar(1)
    state.automatic_dynamic["L['n']"] |= pgo.FrameStateSizeEntry.make_scalar(2)
    monkeypatch.setattr(pgo, "_CODE_STATE", defaultdict(pgo.CodeState, {"code": state}))
    assert dynamic.merge(dynamic.from_pgo()) == (DynamicSource("L['n']"), DynamicSource("L['x']", 0))


def test_compile_report_over_forged_store_marks_is_text_not_a_traceback(tmp_path, capsys):
    """A store mark's fields are the ledger's: `ettr compile-report` raised TypeError on an `entry_bytes`
    string (`size / 1e6`), a mark's own `ts` replaced the row's, and a recompile reason's escape sequence
    reached the terminal."""
    from ettr.cli import main
    from ettr.ledger import open_ledger

    forged = {"name": STORE_MARK, "action": "load", "status": "hit", "ts": "x", "rank": [1]}
    forged.update(entry_bytes="12MB", written_bytes=[1], duration_s=float("inf"))
    ledger = open_ledger(tmp_path)
    ledger.append(
        [
            Event(EventKind.MARK, 5.0, 0, 0, data=forged),
            Event(EventKind.RECOMPILE, 6.0, 0, 0, data={"reason": "evil \x1b]52;c;cGF5bG9hZA==\x07 here"}),
        ]
    )
    ledger.close()
    assert main(["compile-report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "store: load hit" in out and "MB" not in out and "\x1b" not in out and "\\x1b]52" in out
    assert main(["compile-report", str(tmp_path), "--json"]) == 0

    def strict(token: str) -> None:  # JSON has no Infinity/NaN: a strict reader refused the output
        raise ValueError(f"not JSON: {token}")

    (store,) = json.loads(capsys.readouterr().out, parse_constant=strict)["attempts"][0]["store"]
    assert (store["ts"], store["rank"]) == (5.0, 0) and store["duration_s"] is None


def test_compile_report_of_several_ranks_says_the_sum_is_over_ranks_and_the_slowest_rank():
    """Two ranks compiling 66 s side by side printed "132.1 s compiling" for an attempt of 80 s."""
    events = [
        Event(EventKind.PHASE_END, 70.0, 0, 0, Phase.COMPILE, value=4.0, data={"source": "dynamo"}),
        Event(EventKind.PHASE_END, 72.0, 0, 1, Phase.COMPILE, value=4.0, data={"source": "dynamo"}),
        Event(EventKind.RECOMPILE, 20.0, 0, 0, data={"reason": "grad_mode"}),
        Event(EventKind.MARK, 1.0, 0, 0, data={"name": STORE_MARK, "action": "restore", "status": "hit"}),
        Event(
            EventKind.MARK,
            1.0,
            0,
            1,
            data={
                "name": STORE_MARK,
                "action": "restore",
                "status": "hit",
                "already_present": ["inductor_cache"],
            },
        ),
    ]
    (attempt,) = summarize(events)["attempts"]
    assert (attempt["num_compiles"], attempt["compile_s"], attempt["num_ranks"]) == (2, 134.0, 2)
    assert attempt["slowest_rank_compile_s"] == 68.0
    assert [(r["rank"], r["compile_s"], r["num_recompiles"]) for r in attempt["ranks"]] == [
        (0, 66.0, 1),
        (1, 68.0, 0),
    ]
    text = render(summarize(events))
    assert (
        "attempt 0 (2 ranks): 2 compilations, 134.0 s compiling over all ranks (slowest rank 68.0 s)" in text
    )
    assert "store: rank 1 restore hit (its files were already on the node)" in text
    one_rank = render(summarize(events[:1]))
    assert "attempt 0: 1 compilations, 66.0 s compiling, 0 recompiles" in one_rank and "rank" not in one_rank


def _run_dir_with_a_recompile(run_dir):
    from ettr.ledger import open_ledger

    ledger = open_ledger(run_dir)
    ledger.append([Event(EventKind.RECOMPILE, 6.0, 0, 0, data={"reason": "r"})])
    ledger.close()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{broken", "(JSONDecodeError: "),
        (
            '{"schema": "ettr.compile-dynamic/0", "sources": ["L[\'x\']:0"]}',
            "(not an ettr.compile-dynamic/1 file)",
        ),
        ('{"schema": "ettr.compile-dynamic/1", "sources": "abc"}', "(its sources or reasons are not lists)"),
        (None, "(ELOOP (Too many levels of symbolic links))"),  # a symlink, never followed
    ],
)
def test_compile_report_says_an_unreadable_job_file_is_unknown_not_none(tmp_path, capsys, content, why):
    """A damaged or forged `compile/dynamic.json` was reported as `learned dynamic inputs: none`: an
    unknown said as a wrong answer. Now one line says the file could not be read and why; the rest of the
    report is still printed (exit status 0: a side file, not the run directory, is bad)."""
    from ettr.cli import main

    _run_dir_with_a_recompile(tmp_path)
    path = dynamic.job_file(tmp_path)
    path.parent.mkdir(parents=True)
    if content is None:
        (tmp_path / "elsewhere.json").write_text(
            '{"schema": "ettr.compile-dynamic/1", "sources": ["L[\'x\']:0"]}'
        )
        path.symlink_to(tmp_path / "elsewhere.json")
    else:
        path.write_text(content)
    assert main(["compile-report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("learned dynamic inputs")]
    assert line.startswith(f"learned dynamic inputs: unknown, {path} could not be read {why}")
    assert "1 x r" in out and "Traceback" not in out
    assert main(["compile-report", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["learned_dynamic_sources"] == [] and why in summary["learned_dynamic_error"]
    assert dynamic.load(path) == ((), [])  # the next attempt learns afresh, as before


def test_compile_report_of_a_job_that_learned_nothing_says_none(tmp_path, capsys):
    from ettr.cli import main

    _run_dir_with_a_recompile(tmp_path)
    assert main(["compile-report", str(tmp_path)]) == 0
    assert "learned dynamic inputs: none\n" in capsys.readouterr().out
    assert main(["compile-report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["learned_dynamic_error"] is None


@pytest.mark.parametrize("content", ["{broken", '{"spec": 5}', None])
def test_compile_report_says_an_unreadable_fast_batch_spec_is_unknown_not_none(tmp_path, capsys, content):
    """A damaged, forged or symlinked `compile/batch_spec.json` was reported as `fast-batch spec: none`, as if
    the job had kept none: it is unknown, said with why; a run without one still says none."""
    from ettr.cli import main
    from ettr.compile import fastbatch

    _run_dir_with_a_recompile(tmp_path)
    assert main(["compile-report", str(tmp_path)]) == 0
    assert "fast-batch spec: none" in capsys.readouterr().out
    path = fastbatch.job_file(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is None:
        (tmp_path / "elsewhere.json").write_text("{}")
        path.symlink_to(tmp_path / "elsewhere.json")
    else:
        path.write_text(content)
    assert main(["compile-report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("fast-batch spec")]
    assert line.startswith(f"fast-batch spec: unknown, {path} could not be read (")
    assert main(["compile-report", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["batch_spec"] is None and "could not be read" in summary["batch_spec_error"]
    assert fastbatch.load_spec(path) is None  # the next attempt keeps a spec afresh, as before


def test_a_forged_source_that_is_regex_syntax_is_never_applied(tmp_path):
    """Dynamo matches each `dynamic_sources` entry as a regex: a forged `(` in the job file made every
    compilation of every attempt raise; a nested quantifier can backtrack for ever; a comma makes two."""
    torch = pytest.importorskip("torch")
    path = dynamic.job_file(tmp_path)
    path.parent.mkdir(parents=True)
    good = ["L['x']:0", "L['self']._modules['fc']._parameters['weight']:1", "G['n']"]
    bad = [
        "(",
        "L['x']`reboot`",
        "L['x'",
        "(a|a)*$:0",
        "L['x'],.*",
        "L['x']\x1b[2J",
        "L[ 'x']",
        "x" * 2000,
        "a\\d+",
    ]
    path.write_text(json.dumps({"schema": dynamic.SCHEMA, "sources": good + bad, "reasons": []}))
    sources, _ = dynamic.load(path)
    assert [s.render() for s in sources] == sorted(good)
    with torch.compiler.config.patch(dynamic_sources=""):
        value = dynamic.apply(
            [*sources, DynamicSource("("), DynamicSource("(a+)+b", 0)]
        )  # e.g. from a profile
        assert value == ",".join(s.render() for s in sources)
    # Dynamo takes the value (in a process of its own: a compilation here leaves Dynamo's state behind, and
    # the zero-code evaluation hooks' tests after it in this process saw their phases go missing).
    code = (
        "import sys, torch\n"
        "with torch.compiler.config.patch(dynamic_sources=sys.argv[1]):\n"
        "    print(torch.compile(lambda x: x * 2, backend='eager')(torch.ones(3)).tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", code, value], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "[2.0, 2.0, 2.0]" in done.stdout, done.stderr[-2000:]

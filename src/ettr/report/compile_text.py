"""`ettr compile-report RUN_DIR`: the compile summary (`ettr.compile.summary`) of a run directory, as text.

`load` reads a run directory into the summary; `render` prints it for a terminal. A store action's fields
come from the ledger as the job wrote them (or as someone forged them): a size or duration that is not a
finite number is left out of its line, never a traceback, and nothing read reaches the terminal unescaped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ettr.compile import dynamic, fastbatch
from ettr.compile.summary import summarize
from ettr.untrusted import printable


def load(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The compile summary of a run directory. Raises `ettr.errors.UsageError` for a bad directory."""
    from ettr.report.load import read_events

    events = read_events(run_dir)
    sources, reasons, error = dynamic.read(dynamic.job_file(run_dir))
    spec, spec_error = fastbatch.read_spec(fastbatch.job_file(run_dir))
    summary = summarize(events, learned=(sources, reasons), learned_error=error, batch_spec=spec)
    summary["batch_spec_error"] = spec_error  # unknown, not none: the file is there but not readable
    return summary


def _number(value: Any) -> float | None:
    """`value` if it is a finite number (not a bool), else None: a ledger's data is not checked field by field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _store_line(action: Mapping[str, Any]) -> str:
    what = f"{action.get('action', '?')} {action.get('status', '?')}"
    size = _number(action.get("entry_bytes", action.get("loaded_bytes")))
    written = _number(action.get("written_bytes"))
    duration = _number(action.get("duration_s"))
    details = []
    if size is not None:
        details.append(f"{size / 1e6:.1f} MB")
    ahead = action.get("ahead") if isinstance(action.get("ahead"), Mapping) else None
    if ahead is not None:
        details.append(_ahead_detail(ahead))
    version = _version_detail(action)
    if version:
        details.append(version)
    if action.get("action") == "restore" and action.get("already_present") and not action.get("restored"):
        if ahead is None or ahead.get("unused"):
            details.append(
                "its files were already on the node"
            )  # another rank or an earlier attempt put them
    if written is not None:
        details.append(f"{written / 1e6:.1f} MB of it new to the store")
    if action.get("headers") and not action.get("headers_error"):
        details.append(f"precompiled headers {action['headers']}")
    if duration is not None:
        details.append(f"{duration:.2f} s")
    if action.get("error"):
        details.append(str(action["error"]))
    if action.get("headers_error"):
        details.append(f"precompiled headers: {action['headers_error']}")
    return what + (f" ({', '.join(details)})" if details else "")


def _ahead_detail(ahead: Mapping[str, Any]) -> str:
    """What a promoted spare's restore ahead did (`ettr.compile.ahead`), for its session's restore line."""
    if ahead.get("unused"):
        return f"the spare's restore ahead unused: {ahead['unused']}"
    size, took = _number(ahead.get("loaded_bytes")), _number(ahead.get("duration_s"))
    done = [f"{size / 1e6:.1f} MB" if size is not None else "", f"{took:.2f} s" if took is not None else ""]
    said = ", ".join(part for part in done if part)
    return "restored ahead by the spare before its promotion" + (f" ({said})" if said else "")


def _version_detail(action: Mapping[str, Any]) -> str:
    """Whether a restore took the complete version an earlier restore of the process left in place, the store's
    entry having been saved again since (`ettr.compile.in_place`); empty when no such version was offered."""
    said = []
    if action.get("version") == "earlier":
        kept = action.get("earlier_artifacts")
        which = ", ".join(str(name) for name in kept) if isinstance(kept, list) and kept else ""
        said.append("the version in place counted" + (f" ({which}: nothing copied)" if which else ""))
    if action.get("earlier_unused"):
        said.append(f"the version in place not used: {action['earlier_unused']}")
    return ("the store's entry was saved again since; " + "; ".join(said)) if said else ""


def render(summary: Mapping[str, Any]) -> str:
    """The summary as lines of text for a terminal."""
    lines = ["compile report"]
    if not summary["attempts"]:
        lines.append("  no compilation was recorded (torch.compile not used, or compile support off)")
    for a in summary["attempts"]:
        fast = f", fast-batch warm-up {a['fast_start_compile_s']:.1f} s" if a["fast_start_compile_s"] else ""
        several = _number(a.get("num_ranks")) is not None and a["num_ranks"] > 1
        slowest = _number(a.get("slowest_rank_compile_s"))
        if several and slowest is not None:  # rank-seconds: the ranks compile side by side
            lines.append(
                f"  attempt {a['attempt']} ({a['num_ranks']} ranks): {a['num_compiles']} compilations, "
                f"{a['compile_s']:.1f} s compiling over all ranks (slowest rank {slowest:.1f} s){fast}, "
                f"{a['num_recompiles']} recompiles"
            )
        else:
            lines.append(
                f"  attempt {a['attempt']}: {a['num_compiles']} compilations, {a['compile_s']:.1f} s compiling"
                f"{fast}, {a['num_recompiles']} recompiles"
            )
        store_ranks = {action.get("rank") for action in a["store"]}
        for action in a["store"]:
            who = f"rank {action.get('rank')} " if len(store_ranks) > 1 else ""
            lines.append(f"    store: {who}{_store_line(action)}")
    if summary["recompile_reasons"]:
        lines.append("recompile reasons (most frequent first):")
        for item in summary["recompile_reasons"]:
            lines.append(f"  {item['count']} x {item['reason']}")
    if summary.get("learned_dynamic_error"):  # unknown, not none: the file is there but not readable
        lines.append(f"learned dynamic inputs: unknown, {summary['learned_dynamic_error']}")
    elif summary["learned_dynamic_sources"]:
        lines.append("learned dynamic inputs (applied to the next attempt and later jobs):")
        lines.append(f'  TORCH_COMPILE_DYNAMIC_SOURCES="{summary["torch_compile_dynamic_sources"]}"')
    else:
        lines.append("learned dynamic inputs: none")
    if summary.get("batch_spec_error"):
        lines.append(f"fast-batch spec: unknown, {summary['batch_spec_error']}")
    else:
        lines.append(
            "fast-batch spec: " + ("kept from the first real batch" if summary["batch_spec"] else "none")
        )
    return printable("\n".join(lines))  # reasons, errors, sources: the job's words, never its escapes

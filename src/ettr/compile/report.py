"""`ettr compile-report RUN_DIR`: what torch.compile cost a job, why it recompiled, and what was learned.

`summarize` is pure (events and the learned files in, a JSON-ready dict out); `load` reads a run
directory; `render` prints the summary for a terminal.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ettr.compile import dynamic, fastbatch
from ettr.compile.session import STORE_MARK
from ettr.events import Event, EventKind, Phase

SCHEMA = "ettr.compile-report/1"


def _attempt(summary: dict[int, dict[str, Any]], index: int) -> dict[str, Any]:
    if index not in summary:
        summary[index] = {
            "attempt": index,
            "num_compiles": 0,
            "compile_s": 0.0,
            "fast_start_compile_s": 0.0,
            "num_recompiles": 0,
            "recompile_reasons": [],
            "store": [],
        }
    return summary[index]


def summarize(
    events: Sequence[Event],
    *,
    learned: tuple[Sequence[dynamic.DynamicSource], Sequence[Mapping[str, Any]]] = ((), ()),
    batch_spec: Any = None,
) -> dict[str, Any]:
    """The compile summary of a job's events (`learned`: the job's dynamic sources and reasons file)."""
    attempts: dict[int, dict[str, Any]] = {}
    reasons: Counter[str] = Counter()
    for e in events:
        if e.kind == EventKind.PHASE_END and e.phase == Phase.COMPILE and e.value is not None:
            data = e.data or {}
            a = _attempt(attempts, e.attempt)
            if data.get("source") == "dynamo":
                a["num_compiles"] += 1
                a["compile_s"] += max(0.0, e.ts - e.value)
            elif data.get("source") == "fast_start":
                a["fast_start_compile_s"] += max(0.0, e.ts - e.value)
        elif e.kind == EventKind.RECOMPILE:
            reason = str((e.data or {}).get("reason", ""))
            a = _attempt(attempts, e.attempt)
            a["num_recompiles"] += 1
            a["recompile_reasons"].append(reason)
            reasons[reason] += 1
        elif e.kind == EventKind.MARK and (e.data or {}).get("name") == STORE_MARK:
            data = {k: v for k, v in (e.data or {}).items() if k != "name"}
            _attempt(attempts, e.attempt)["store"].append({"ts": e.ts, "rank": e.rank, **data})
    for a in attempts.values():
        a["compile_s"] = round(a["compile_s"], 3)
        a["fast_start_compile_s"] = round(a["fast_start_compile_s"], 3)
    sources, learned_reasons = learned
    return {
        "schema": SCHEMA,
        "attempts": [attempts[i] for i in sorted(attempts)],
        "num_recompiles": sum(reasons.values()),
        "recompile_reasons": [{"reason": r, "count": n} for r, n in reasons.most_common()],
        "learned_dynamic_sources": [s.render() for s in sources],
        "torch_compile_dynamic_sources": dynamic.render(sources),
        "num_learned_reasons": len(learned_reasons),
        "batch_spec": None if batch_spec is None else fastbatch.spec_to_json(batch_spec)["spec"],
    }


def load(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The compile summary of a run directory. Raises `ettr.errors.UsageError` for a bad directory."""
    from ettr.report.load import read_events

    events = read_events(run_dir)
    return summarize(
        events,
        learned=dynamic.load(dynamic.job_file(run_dir)),
        batch_spec=fastbatch.load_spec(fastbatch.job_file(run_dir)),
    )


def _store_line(action: Mapping[str, Any]) -> str:
    what = f"{action.get('action', '?')} {action.get('status', '?')}"
    size = action.get("entry_bytes", action.get("loaded_bytes"))
    details = []
    if size is not None:
        details.append(f"{size / 1e6:.1f} MB")
    if action.get("duration_s") is not None:
        details.append(f"{action['duration_s']:.2f} s")
    if action.get("error"):
        details.append(str(action["error"]))
    return what + (f" ({', '.join(details)})" if details else "")


def render(summary: Mapping[str, Any]) -> str:
    """The summary as lines of text for a terminal."""
    lines = ["compile report"]
    if not summary["attempts"]:
        lines.append("  no compilation was recorded (torch.compile not used, or compile support off)")
    for a in summary["attempts"]:
        fast = f", fast-batch warm-up {a['fast_start_compile_s']:.1f} s" if a["fast_start_compile_s"] else ""
        lines.append(
            f"  attempt {a['attempt']}: {a['num_compiles']} compilations, {a['compile_s']:.1f} s compiling"
            f"{fast}, {a['num_recompiles']} recompiles"
        )
        for action in a["store"]:
            lines.append(f"    store: {_store_line(action)}")
    if summary["recompile_reasons"]:
        lines.append("recompile reasons (most frequent first):")
        for item in summary["recompile_reasons"]:
            lines.append(f"  {item['count']} x {item['reason']}")
    if summary["learned_dynamic_sources"]:
        lines.append("learned dynamic inputs (applied to the next attempt and later jobs):")
        lines.append(f'  TORCH_COMPILE_DYNAMIC_SOURCES="{summary["torch_compile_dynamic_sources"]}"')
    else:
        lines.append("learned dynamic inputs: none")
    lines.append(
        "fast-batch spec: " + ("kept from the first real batch" if summary["batch_spec"] else "none")
    )
    return "\n".join(lines)

"""What torch.compile cost a job, why it recompiled, and what was learned: the compile summary.

`summarize` is pure (events and the learned files in, a JSON-ready dict out). `ettr compile-report` reads a
run directory and prints it with `ettr.report.compile_text`.
"""

from __future__ import annotations

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
            "ranks": {},
        }
    return summary[index]


def _rank(attempt: dict[str, Any], rank: int) -> dict[str, Any]:
    ranks: dict[int, dict[str, Any]] = attempt["ranks"]
    if rank not in ranks:
        ranks[rank] = {"rank": rank, "num_compiles": 0, "compile_s": 0.0, "num_recompiles": 0}
    return ranks[rank]


def summarize(
    events: Sequence[Event],
    *,
    learned: tuple[Sequence[dynamic.DynamicSource], Sequence[Mapping[str, Any]]] = ((), ()),
    batch_spec: Any = None,
    learned_error: str | None = None,
) -> dict[str, Any]:
    """The compile summary of a job's events (`learned`: the job's dynamic sources and reasons file;
    `learned_error`: why that file could not be read, then what was learned is unknown, not none)."""
    attempts: dict[int, dict[str, Any]] = {}
    reasons: Counter[str] = Counter()
    for e in events:
        if e.kind == EventKind.PHASE_END and e.phase == Phase.COMPILE and e.value is not None:
            data = e.data or {}
            a = _attempt(attempts, e.attempt)
            if data.get("source") == "dynamo":
                a["num_compiles"] += 1
                a["compile_s"] += max(0.0, e.ts - e.value)
                r = _rank(a, e.rank)
                r["num_compiles"] += 1
                r["compile_s"] += max(0.0, e.ts - e.value)
            elif data.get("source") == "fast_start":
                a["fast_start_compile_s"] += max(0.0, e.ts - e.value)
        elif e.kind == EventKind.RECOMPILE:
            reason = str((e.data or {}).get("reason", ""))
            a = _attempt(attempts, e.attempt)
            a["num_recompiles"] += 1
            _rank(a, e.rank)["num_recompiles"] += 1
            a["recompile_reasons"].append(reason)
            reasons[reason] += 1
        elif e.kind == EventKind.MARK and (e.data or {}).get("name") == STORE_MARK:
            data = {k: v for k, v in (e.data or {}).items() if k != "name"}
            _attempt(attempts, e.attempt)["store"].append(
                {**data, "ts": e.ts, "rank": e.rank}
            )  # the row's own
    for a in attempts.values():
        a["compile_s"] = round(a["compile_s"], 3)
        a["fast_start_compile_s"] = round(a["fast_start_compile_s"], 3)
        # `num_compiles`, `compile_s` and `num_recompiles` add up every rank's; the ranks compile side by
        # side, so what the attempt waited for is about the slowest rank's (`slowest_rank_compile_s`).
        ranks = [a["ranks"][r] for r in sorted(a["ranks"])]
        for r in ranks:
            r["compile_s"] = round(r["compile_s"], 3)
        a["ranks"] = ranks
        a["num_ranks"] = len(ranks)
        a["slowest_rank_compile_s"] = max((r["compile_s"] for r in ranks), default=0.0)
    sources, learned_reasons = learned
    return {
        "schema": SCHEMA,
        "attempts": [attempts[i] for i in sorted(attempts)],
        "num_recompiles": sum(reasons.values()),
        "recompile_reasons": [{"reason": r, "count": n} for r, n in reasons.most_common()],
        "learned_dynamic_sources": [s.render() for s in sources],
        "torch_compile_dynamic_sources": dynamic.render(sources),
        "num_learned_reasons": len(learned_reasons),
        "learned_dynamic_error": learned_error,
        "batch_spec": None if batch_spec is None else fastbatch.spec_to_json(batch_spec)["spec"],
    }

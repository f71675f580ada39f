"""A compile store restore with several precompiled-header variants: every variant copied (as before
2026-12-05) against only those the header memo names for this build (`pch_memo.wanted_headers`).

    PYTHONPATH=src .venv/bin/python benchmarks/header_restore.py STORE USER_KEY [--rounds 3]

STORE is a local compile store holding the workload entry of USER_KEY (with its `ettr-pch.json`, written by
a process of this worktree's torch) and its build's header entry; nothing in it is changed but the entries'
last-use records. Each round restores both ways, interleaved (order alternating), into fresh directories,
and prints each restore's wall time and bytes copied, then the medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ettr.compile import pch_memo
from ettr.compile.key import current_key
from ettr.compile.restore import EntryView, StoreRestorer
from ettr.compile.store import CompileStore, StoreConfig


def restore_once(store: CompileStore, user_key: str, only_wanted: bool) -> tuple[float, int, str]:
    scratch = Path(tempfile.mkdtemp(prefix="ettr-header-restore-"))
    try:
        cache, headers = scratch / "cache", scratch / "headers"
        restorer = StoreRestorer(
            store=lambda: store,
            key=lambda: current_key(user_key=user_key, device_type="cpu"),
            view=EntryView(),
            mark=lambda _begin, _info: None,
            wanted_headers=pch_memo.wanted_headers if only_wanted else None,
        )
        begin = time.perf_counter()
        restorer.restore_once((cache, headers))
        wall = time.perf_counter() - begin
        info = restorer.last_restore or {}
        return wall, int(info.get("loaded_bytes", 0)), str(info.get("header_variants", "all"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("user_key")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    store = CompileStore.open(StoreConfig(location=args.store))
    results: dict[str, list[tuple[float, int]]] = {"every variant": [], "wanted variants": []}
    for round_no in range(args.rounds):
        order = [False, True] if round_no % 2 == 0 else [True, False]
        for only_wanted in order:
            wall, copied, variants = restore_once(store, args.user_key, only_wanted)
            name = "wanted variants" if only_wanted else "every variant"
            results[name].append((wall, copied))
            print(
                f"round {round_no}: {name:15} {wall:6.2f} s  {copied / 1e6:7.1f} MB  (header variants {variants})"
            )
    for name, runs in results.items():
        print(
            f"median {name:15} {statistics.median(w for w, _ in runs):6.2f} s  "
            f"{statistics.median(c for _, c in runs) / 1e6:7.1f} MB"
        )


if __name__ == "__main__":
    main()

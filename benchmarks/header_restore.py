"""A compile store restore with several precompiled-header variants: every variant copied (as before
2026-12-05) against only those the header memo names for this build (`pch_memo.wanted_headers`).

    PYTHONPATH=src .venv/bin/python benchmarks/header_restore.py [STORE USER_KEY] [--rounds 3] [--json] [--quick]

STORE is a local compile store holding the workload entry of USER_KEY (with its `ettr-pch.json`, written by
a process of this worktree's torch) and its build's header entry; nothing in it is changed but the entries'
last-use records. Without them, a store of its own is built in a temporary directory: a workload entry whose
memo names one of two header variants of 157 MB each (the size of inductor's precompiled header here; random
bytes, the restore's copy and checksum are what is timed), 4 MB each and 2 rounds with `--quick`. Each round
restores both ways, interleaved (order alternating), into fresh directories, and prints each restore's wall
time and bytes copied, then the medians; `--json` adds them as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ettr.compile import artifacts, pch_memo
from ettr.compile.key import StoreKey, current_key
from ettr.compile.restore import EntryView, StoreRestorer
from ettr.compile.store import CompileStore, StoreConfig

SYNTHETIC_HEADER = "torch/csrc/inductor/cpp_prefix.h"


def synthetic_store(location: Path, variant_bytes: int) -> tuple[CompileStore, StoreKey]:
    """A store of its own: a workload entry whose header memo names variant `cnew.h` under this build's own
    key (`pch_memo.memo_key` of torch's header, as a process of this build wrote it), and a header entry
    holding it and `cold.h` (the variant of an older command line), `variant_bytes` each. Where this torch
    has no such header the memo's key is nobody's and every variant is restored both ways."""
    store = CompileStore.open(StoreConfig(location=str(location)))
    key = current_key(user_key="header-restore-benchmark", device_type="cpu")
    entries = [
        {
            "call": json.dumps([SYNTHETIC_HEADER, cmd, []]),
            "key": pch_memo.memo_key(SYNTHETIC_HEADER),
            "header": name,
        }
        for name, cmd in (("cnew.h", "g++ -mavx512bf16"), ("cold.h", "g++"))
    ]
    memo = json.dumps({"schema": pch_memo.MEMO_SCHEMA, "entries": entries[:1]}).encode()
    store.save(key, {artifacts.INDUCTOR_ARCHIVE: {"fxgraph/k": b"kernel", pch_memo.MEMO_NAME: memo}})
    headers: dict[str, bytes] = {}
    for name in ("cnew.h", "cold.h"):
        headers[name] = f"#include <{name}>\n".encode()
        headers[f"{name}.gch"] = os.urandom(variant_bytes)
    store.save(key.headers_key(), {artifacts.HEADERS_ARCHIVE: headers}, meta={"kind": "precompiled-headers"})
    return store, key


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
    parser.add_argument("store", nargs="?")
    parser.add_argument("user_key", nargs="?")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    scratch = None
    if args.store and args.user_key:
        store, user_key = CompileStore.open(StoreConfig(location=args.store)), args.user_key
    else:
        scratch = Path(tempfile.mkdtemp(prefix="ettr-header-store-"))
        store, key = synthetic_store(scratch, (4 if args.quick else 157) * 1_000_000)
        user_key = key.user_key
    rounds = 2 if args.quick else args.rounds
    results: dict[str, list[tuple[float, int]]] = {"every variant": [], "wanted variants": []}
    try:
        for round_no in range(rounds):
            order = [False, True] if round_no % 2 == 0 else [True, False]
            for only_wanted in order:
                wall, copied, variants = restore_once(store, user_key, only_wanted)
                name = "wanted variants" if only_wanted else "every variant"
                results[name].append((wall, copied))
                print(
                    f"round {round_no}: {name:15} {wall:6.2f} s  {copied / 1e6:7.1f} MB  (header variants {variants})"
                )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    medians = {}
    for name, runs in results.items():
        wall_s, copied_b = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        medians[name] = (wall_s, copied_b)
        print(f"median {name:15} {wall_s:6.2f} s  {copied_b / 1e6:7.1f} MB")
    if args.json:
        every, wanted = medians["every variant"], medians["wanted variants"]
        figures = {
            "quick": args.quick,
            "synthetic": scratch is not None,
            "every_variant_s": every[0],
            "wanted_variants_s": wanted[0],
            "every_variant_bytes": every[1],
            "wanted_variants_bytes": wanted[1],
            "ratio_wanted_over_every_s": wanted[0] / every[0] if every[0] > 0 else None,
        }
        print(json.dumps(figures))


if __name__ == "__main__":
    main()

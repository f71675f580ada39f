"""Compile store size and save time for 1, 5 and 20 small models, shared store vs one copy per model,
side by side in one run.

Each model is a different small CNN (3 conv layers; widths differ per model, so each compiles its own
kernels) trained for a few steps with `torch.compile` (inductor, CPU) in a fresh Python process with a
fresh `TMPDIR` — a job on a fresh node — under `ettr.compile.autoinstall`, pointed at one store with the
model's own key (`ETTR_COMPILE_KEY=model-<i>`). Its save is the real one: its entry (inductor's cache
directory, the megacache archive) and the build's precompiled headers, which a model after the first
restores from the store instead of building (and then does not save again).

Beside each model, the benchmark saves the same files the way one copy per model keeps them — the model's
cache directory and the precompiled headers in a store of their own — and times that save
(`unshared`); the sum of those stores is the size the store had before files were shared (each entry held
the ~470 MB header). Sizes are bytes on disk (`du`), medians of save seconds over the models.

`--json` ends with one object: `store_bytes`, `unshared_bytes` and `size_ratio` after the last model;
`first_save_s` (the first model: it saves the header), `later_save_s_median` and
`later_unshared_save_s_median` (the models after it); `at` (for 1, 5 and the last model count:
store_bytes, unshared_bytes, ratio, save_s_median and unshared_save_s_median over those models);
`models` (each model's save); `quick`; `config`. `--quick` runs 2 models (the same parts: one that builds
and saves the header, one that restores it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


# -- one model's job (a child process) -------------------------------------------------------------------
def _child(index: int, run_dir: str) -> None:
    import torch
    from torch import nn

    import ettr
    import ettr.compile
    from ettr.compile import artifacts

    rec = ettr.init(run_dir)
    ettr.compile.autoinstall(rec)
    width = 4 + 2 * index  # every model its own shapes, so its own kernels
    model = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 4, 3, padding=1),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model)
    for _ in range(3):
        loss = nn.functional.cross_entropy(compiled(torch.randn(8, 3, 8, 8)), torch.randint(0, 10, (8,)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    session = ettr.compile.current_session()
    assert session is not None, "autoinstall did not start a compile session"
    session.save(reason="benchmark")
    out = {
        "restore": session.last_restore,
        "save": session.last_save,
        "cache_dir": str(artifacts.inductor_cache_dir()),
        "headers_dir": str(artifacts.headers_dir()),
    }
    rec.close()
    print("RESULT " + json.dumps(out), flush=True)


CHILD_TIMEOUT_S = 1800.0
"""The longest one model's child may take (a first compile at load 40-50 took longer: one line, exit 2)."""


class ModelFailed(Exception):
    """One model's child failed or did not finish: the benchmark ends with one line."""


def _run_child(index: int, store: Path, work: Path) -> dict:
    tmp = work / "tmp"
    tmp.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETTR_", "TORCHINDUCTOR_"))}
    env.update(
        TMPDIR=str(tmp),
        ETTR_COMPILE_STORE=str(store),
        ETTR_COMPILE_KEY=f"model-{index}",
        ETTR_COMPILE_SETTLE_S="3600",  # the child saves once, when it is done
        PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")]),
    )
    try:
        done = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                str(index),
                "--run-dir",
                str(work / "run"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ModelFailed(f"model {index} did not finish within {CHILD_TIMEOUT_S:.0f} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise ModelFailed(f"model {index} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _du(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _unshared_save(child: dict, work: Path) -> tuple[float, int]:
    """Save the model's files as one copy per model keeps them (a store of their own); (seconds, bytes)."""
    from ettr.compile import artifacts
    from ettr.compile.backend import LocalBackend
    from ettr.compile.key import StoreKey
    from ettr.compile.store import CompileStore

    store_dir = work / "unshared-store"
    store = CompileStore(LocalBackend(store_dir))
    key = StoreKey(
        torch_version="t",
        python_version="p",
        platform="x",
        device_type="cpu",
        inductor_config="c",
        user_key="m",
    )
    headers = Path(child["headers_dir"])
    trees = {
        artifacts.INDUCTOR_ARCHIVE: artifacts.tree(Path(child["cache_dir"]), exclude=headers),
        artifacts.HEADERS_ARCHIVE: artifacts.tree(headers),
    }
    begin = time.perf_counter()
    store.save(key, {name: tree for name, tree in trees.items() if tree})
    seconds = time.perf_counter() - begin
    size = _du(store_dir)
    shutil.rmtree(store_dir, ignore_errors=True)
    return seconds, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--quick", action="store_true", help="2 models instead of 20")
    parser.add_argument("--models", type=int, default=20, help="models in all (reported at 1, 5 and this)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.run_dir)
        return 0
    num_models = 2 if args.quick else args.models
    marks = sorted({n for n in (1, 5, num_models) if n <= num_models})
    base = Path(tempfile.mkdtemp(prefix="ettr-bench-store-"))
    store = base / "store"
    models, at = [], {}
    unshared_total = 0
    try:
        for index in range(num_models):
            work = base / f"model-{index}"
            child = _run_child(index, store, work)
            save = child["save"] or {}
            unshared_s, unshared_bytes = _unshared_save(child, work)
            unshared_total += unshared_bytes
            models.append(
                {
                    "model": index,
                    "restore": (child["restore"] or {}).get("status"),
                    "restored": (child["restore"] or {}).get("restored"),
                    "save_s": save.get("duration_s"),
                    "entry_bytes": save.get("entry_bytes"),
                    "written_bytes": save.get("written_bytes"),
                    "headers": save.get("headers"),
                    "headers_written_bytes": save.get("headers_written_bytes"),
                    "unshared_save_s": unshared_s,
                    "unshared_bytes": unshared_bytes,
                }
            )
            shutil.rmtree(work, ignore_errors=True)
            print(
                f"model {index}: save {save.get('duration_s', float('nan')):.2f} s "
                f"({(save.get('written_bytes') or 0) / 1e6:.1f} MB new, headers {save.get('headers')}); "
                f"one copy per model: {unshared_s:.2f} s, {unshared_bytes / 1e6:.1f} MB",
                flush=True,
            )
            count = index + 1
            if count in marks:
                stored = _du(store)
                these = models[:count]
                at[str(count)] = {
                    "store_bytes": stored,
                    "unshared_bytes": unshared_total,
                    "ratio": unshared_total / stored if stored else None,
                    "save_s_median": statistics.median(m["save_s"] for m in these),
                    "unshared_save_s_median": statistics.median(m["unshared_save_s"] for m in these),
                }
                print(
                    f"{count} model(s): store {stored / 1e6:.1f} MB, one copy per model {unshared_total / 1e6:.1f} MB "
                    f"({at[str(count)]['ratio']:.1f}x); save median {at[str(count)]['save_s_median']:.2f} s vs "
                    f"{at[str(count)]['unshared_save_s_median']:.2f} s",
                    flush=True,
                )
    except ModelFailed as exc:
        print(f"compile_store: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        last = at[str(num_models)]
        later = models[1:] or models
        print(
            json.dumps(
                {
                    "store_bytes": last["store_bytes"],
                    "unshared_bytes": last["unshared_bytes"],
                    "size_ratio": last["ratio"],
                    "first_save_s": models[0]["save_s"],
                    "later_save_s_median": statistics.median(m["save_s"] for m in later),
                    "later_unshared_save_s_median": statistics.median(m["unshared_save_s"] for m in later),
                    "at": at,
                    "models": models,
                    "quick": args.quick,
                    "config": {"num_models": num_models},
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

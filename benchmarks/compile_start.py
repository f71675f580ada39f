"""Compile start-up, side by side in one run: first-step time cold / MegaCache / ettr store, and TTS of a
job with a slow data loader and a slow checkpoint read, sequential vs overlapped (`ettr.compile.fast_start`).

Every measurement is a fresh Python process with a fresh `TORCHINDUCTOR_CACHE_DIR` and a fresh `TMPDIR`
(inductor's precompiled header lives there), so cold is truly cold. Each of `--runs` rounds runs, in turn:

* `sequential` — the job: read the checkpoint, wait for the first batch, then the first training step,
  which compiles cold. Its first step is the **cold** first-step time; its TTS is the sequential TTS.
  After measuring, it saves the MegaCache archive and (at exit, through `ettr.compile.autoinstall`) the
  ettr store entry that the next two runs of the round start from.
* `megacache` — first step after `torch.compiler.load_cache_artifacts()` of that archive (load included).
* `ettr_store` — first step with `ettr.compile.autoinstall()` pointed at that store (the restore, which
  starts on a helper thread at `torch.compile()`, is counted in full).
* `overlapped` — the job again, cold, with `fast_start`: compile on a synthetic batch while the loader's
  workers warm up and the checkpoint is read.

The model is a small transformer (`--layers` blocks, width 64) trained with SGD; its cold compile on CPU is
dominated by inductor's C++ work. The data loader's two workers take `--data-warmup-s` before their first
batch (remote shards opening); the checkpoint (~`--ckpt-mb` MB) is read at a throttled bandwidth so that
the read takes about `--ckpt-read-s` (network storage). TTS is measured from the process's start (from
/proc) to the end of its first training step. `longest_phase` is the median, over the sequential runs, of
the longest of (compile, data-loader warm-up, checkpoint read) each measured alone.

`--json` ends with one object: first_step_s {cold, megacache, ettr_store} (medians), tts_s {sequential,
overlapped, longest_phase} (medians), ratios, phases_s, process_cpu_s (CPU seconds of each run's process
tree: steadier than wall time when others load the machine), runs (every measurement), config. `--quick` (what
CI runs): one round, a 1 s data-loader warm-up, an 8 MB checkpoint read in 0.5 s, and one TMPDIR for the
round's processes (inductor's precompiled header, minutes of a loaded machine, is built once: by the cold
run); the megacache and overlapped runs reuse the cold run's inductor cache instead of compiling again (their
figures then say nothing: quick figures are not quoted).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# -- the job (runs in child processes) -------------------------------------------------------------------
SEQ_LEN, WIDTH, BATCH = 16, 64, 8


def _build_model(num_layers: int):  # noqa: ANN202 - torch is imported lazily in children only
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    torch.manual_seed(0)
    return nn.Sequential(*[Block(WIDTH) for _ in range(num_layers)])


class _SlowStartDataset:
    """Map-style dataset whose workers take `warmup_s` to start (opening remote shards)."""

    def __init__(self, warmup_s: float) -> None:
        self.warmup_s = warmup_s

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, index: int):  # noqa: ANN204
        import torch

        g = torch.Generator().manual_seed(index)
        return torch.randn(SEQ_LEN, WIDTH, generator=g), torch.randn(SEQ_LEN, WIDTH, generator=g)


def _worker_init(worker_id: int) -> None:
    import torch.utils.data

    time.sleep(torch.utils.data.get_worker_info().dataset.warmup_s)


def _read_checkpoint(path: str, bandwidth_bytes_s: float):  # noqa: ANN202
    """torch.load of a file read in 4 MiB chunks at most `bandwidth_bytes_s` (a network file system)."""
    import io

    import torch

    buffer = io.BytesIO()
    begin = time.time()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            buffer.write(chunk)
            ahead = begin + buffer.tell() / bandwidth_bytes_s - time.time()
            if ahead > 0:
                time.sleep(ahead)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


def _child(args: argparse.Namespace) -> None:
    from ettr.procs import process_start_time

    process_start_ts = process_start_time()
    import torch

    import ettr
    import ettr.compile
    from ettr.events import Phase

    out: dict = {"variant": args.child}
    rec = ettr.init(args.run_dir, job_id=f"bench-{args.child}") if args.run_dir else None
    if args.store:
        config = ettr.compile.CompileConfig(
            store=args.store, user_key="compile-start-bench", settle_s=1e9, save_at_exit=args.save_store
        )
        ettr.compile.autoinstall(rec, config=config)
    model = _build_model(args.layers)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_of(batch):  # noqa: ANN001, ANN202
        x, y = batch
        return (compiled(x) - y).square().mean()

    def train_step(batch) -> None:  # noqa: ANN001
        loss_of(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if args.child in ("megacache", "ettr_store"):
        batch = (torch.randn(BATCH, SEQ_LEN, WIDTH), torch.randn(BATCH, SEQ_LEN, WIDTH))
        t0 = time.time()
        if args.child == "megacache":
            torch.compiler.load_cache_artifacts(Path(args.megacache).read_bytes())
        train_step(batch)
        t1 = time.time()
        first_step_s = t1 - t0
        session = ettr.compile.current_session()
        if session is not None and session.last_restore:
            # The store restores on a helper thread from `torch.compile()` on; whatever part of it ran
            # before t0 is added, so the restore counts in full even where it overlapped other work.
            restore = session.last_restore
            first_step_s += max(
                0.0, min(restore["begin_ts"] + restore["duration_s"], t0) - restore["begin_ts"]
            )
            out["restore"] = {k: restore.get(k) for k in ("status", "duration_s", "restored", "num_files")}
        out.update(first_step_s=first_step_s, process_to_first_step_s=t1 - process_start_ts)
    else:
        loader = torch.utils.data.DataLoader(
            _SlowStartDataset(args.data_warmup_s),
            batch_size=BATCH,
            num_workers=2,
            worker_init_fn=_worker_init,
            persistent_workers=True,
        )
        bandwidth = os.path.getsize(args.ckpt) / args.ckpt_read_s

        if args.child == "sequential":
            t = time.time()
            state = _read_checkpoint(args.ckpt, bandwidth)
            model.load_state_dict(state["model"])
            restore_s = time.time() - t
            if rec is not None:
                rec.span(Phase.RESTORE, t)
            t = time.time()
            batch = next(iter(loader))
            data_s = time.time() - t
            if rec is not None:
                rec.span(Phase.GET_FIRST_BATCH_DATA, t)
            t0 = time.time()
            train_step(batch)
            t1 = time.time()
            out.update(
                phases_s={"compile": t1 - t0, "data": data_s, "restore": restore_s}, first_step_s=t1 - t0
            )
        else:
            from ettr.compile import TensorSpec, fast_start, warm_up

            spec = (
                TensorSpec(shape=(BATCH, SEQ_LEN, WIDTH), dtype="float32", low=-3, high=3),
                TensorSpec(shape=(BATCH, SEQ_LEN, WIDTH), dtype="float32", low=-3, high=3),
            )
            it = iter(loader)  # forks the workers before any compile thread runs
            result = fast_start(
                warm_up(model, loss_of),
                lambda: next(it),
                restore=lambda: _read_checkpoint(args.ckpt, bandwidth),
                spec=spec,
                rec=rec,
            )
            model.load_state_dict(result.restored["model"])
            t0 = time.time()
            train_step(result.first_batch)
            t1 = time.time()
            out.update(phases_s=dict(result.phases_s), startup_wall_s=result.wall_s, first_step_s=t1 - t0)
        out["tts_s"] = t1 - process_start_ts
        if rec is not None:
            rec.step(1)
        if args.megacache and args.child == "sequential":
            saved = torch.compiler.save_cache_artifacts()
            Path(args.megacache).write_bytes(saved[0])
    from torch._dynamo.utils import counters

    out["cache"] = {k: v for k, v in counters["inductor"].items() if "cache" in k}
    out["cache"].update({f"aot_{k}": v for k, v in counters["aot_autograd"].items() if "cache" in k})
    print("RESULT " + json.dumps(out), flush=True)


# -- the orchestration (parent) --------------------------------------------------------------------------
def _run_child(
    variant: str,
    work: Path,
    opts: argparse.Namespace,
    inductor_cache: Path | None = None,
    **paths: str | bool,
) -> dict:
    fresh = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=work))
    # Quick mode: one TMPDIR for all, so inductor's precompiled header is built once (by the cold run).
    tmp = work / "shared-tmp" if opts.quick else fresh / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache or fresh / "inductor"),
        "PYTHONUNBUFFERED": "1",
    }
    for name in (
        "ETTR_RUN_DIR",
        "ETTR_ATTEMPT",
        "ETTR_JOB_ID",
        "TORCH_COMPILE_DYNAMIC_SOURCES",
        "TORCH_LOGS",
    ):
        env.pop(name, None)
    argv = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--layers",
        str(opts.layers),
        "--data-warmup-s",
        str(opts.data_warmup_s),
        "--ckpt-read-s",
        str(opts.ckpt_read_s),
        "--run-dir",
        str(fresh / "run"),
    ]
    for name, value in paths.items():
        if value is True:
            argv.append(f"--{name.replace('_', '-')}")
        elif value:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} run failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["run_dir"] = str(fresh / "run")
    result["inductor_cache"] = str(inductor_cache or fresh / "inductor")
    # CPU seconds of the whole process tree (the compiler runs in subprocesses): steadier than wall time
    # on a machine other people load, though it includes imports and the exit-time save.
    result["process_cpu_s"] = round(
        (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime), 2
    )
    return result


def _write_checkpoint(path: Path, num_layers: int, size_mb: int) -> None:
    import torch

    model = _build_model(num_layers)
    ballast = torch.randn(max(0, size_mb * (1 << 20) // 4))  # optimizer state, embeddings, ...
    torch.save({"model": model.state_dict(), "extra": ballast}, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument(
        "--runs", type=int, default=3, help="rounds (each: sequential, megacache, store, overlapped)"
    )
    parser.add_argument(
        "--layers", type=int, default=1, help="transformer blocks (cold compile >= 20 s here)"
    )
    parser.add_argument("--data-warmup-s", type=float, default=10.0, help="data-loader workers' start-up")
    parser.add_argument("--ckpt-read-s", type=float, default=5.0, help="time to read the checkpoint")
    parser.add_argument("--ckpt-mb", type=int, default=128, help="checkpoint size")
    parser.add_argument(
        "--quick", action="store_true", help="one round, short waits (CI's check that it runs)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--save-store", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--megacache", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if args.quick:
        args.runs, args.data_warmup_s, args.ckpt_read_s, args.ckpt_mb = 1, 1.0, 0.5, 8
    if args.runs < 1 or args.layers < 1 or args.data_warmup_s < 0 or args.ckpt_read_s <= 0:
        parser.error("--runs and --layers must be >= 1, --data-warmup-s >= 0, --ckpt-read-s > 0")

    began = time.time()
    runs: dict[str, list[dict]] = {v: [] for v in ("sequential", "megacache", "ettr_store", "overlapped")}
    with tempfile.TemporaryDirectory(prefix="ettr-compile-bench-") as tmp:
        work = Path(tmp)
        ckpt = work / "checkpoint.pt"
        _write_checkpoint(ckpt, args.layers, args.ckpt_mb)
        for round_index in range(args.runs):
            store, mega = work / f"store-{round_index}", work / f"megacache-{round_index}.bin"
            seq = _run_child(
                "sequential", work, args, ckpt=ckpt, store=store, save_store=True, megacache=mega
            )
            runs["sequential"].append(seq)
            # Quick mode: the megacache and overlapped runs find the sequential run's inductor cache, so
            # that neither builds the same kernels' C++ again (each cost about as many CPU seconds as the
            # cold run); their paths are the same (the archive loaded, then the first step; fast_start's
            # compile on its helper thread while the loader warms up and the checkpoint is read). The ettr
            # store's run starts from an empty cache as always. The full run gives every run a fresh cache,
            # as it measures.
            warm = Path(seq["inductor_cache"]) if args.quick else None
            runs["megacache"].append(_run_child("megacache", work, args, inductor_cache=warm, megacache=mega))
            runs["ettr_store"].append(_run_child("ettr_store", work, args, store=store))
            runs["overlapped"].append(
                _run_child(
                    "overlapped",
                    work,
                    args,
                    inductor_cache=warm,
                    ckpt=ckpt,
                    store=work / f"empty-{round_index}",
                )
            )
            last = {v: runs[v][-1] for v in runs}
            print(
                f"round {round_index + 1}/{args.runs}: first step cold {last['sequential']['first_step_s']:.1f} s, "
                f"megacache {last['megacache']['first_step_s']:.1f} s, "
                f"ettr store {last['ettr_store']['first_step_s']:.2f} s "
                f"(restore {last['ettr_store'].get('restore', {}).get('status')}); "
                f"TTS sequential {last['sequential']['tts_s']:.1f} s, overlapped {last['overlapped']['tts_s']:.1f} s",
                flush=True,
            )

    def med(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    first_step = {
        "cold": med([r["first_step_s"] for r in runs["sequential"]]),
        "megacache": med([r["first_step_s"] for r in runs["megacache"]]),
        "ettr_store": med([r["first_step_s"] for r in runs["ettr_store"]]),
    }
    tts = {
        "sequential": med([r["tts_s"] for r in runs["sequential"]]),
        "overlapped": med([r["tts_s"] for r in runs["overlapped"]]),
        "longest_phase": med([max(r["phases_s"].values()) for r in runs["sequential"]]),
    }
    ratios = {
        "megacache_over_cold": round(first_step["megacache"] / first_step["cold"], 3),
        "ettr_store_over_cold": round(first_step["ettr_store"] / first_step["cold"], 3),
        "overlapped_over_longest_phase": round(tts["overlapped"] / tts["longest_phase"], 3),
        "overlapped_over_sequential": round(tts["overlapped"] / tts["sequential"], 3),
    }
    cpu = {v: med([r["process_cpu_s"] for r in runs[v]]) for v in runs}
    phase_medians = {
        variant: {p: med([r["phases_s"][p] for r in runs[variant]]) for p in ("compile", "data", "restore")}
        for variant in ("sequential", "overlapped")
    }
    print(
        f"model: {args.layers} transformer blocks, width {WIDTH}; {args.runs} rounds; {time.time() - began:.0f} s"
    )
    print("first-step time (median; fresh process, fresh inductor cache dir and TMPDIR):")
    print(f"  cold                 {first_step['cold']:7.2f} s")
    print(
        f"  MegaCache archive    {first_step['megacache']:7.2f} s  ({ratios['megacache_over_cold']:.0%} of cold)"
    )
    print(
        f"  ettr store           {first_step['ettr_store']:7.2f} s  ({ratios['ettr_store_over_cold']:.0%} of cold)"
    )
    print(
        f"  whole-process CPU s (median): sequential/cold {cpu['sequential']}, megacache {cpu['megacache']}, "
        f"ettr store {cpu['ettr_store']}, overlapped {cpu['overlapped']}"
    )
    print(
        f"time to start (median; data-loader warm-up {args.data_warmup_s:g} s, checkpoint read {args.ckpt_read_s:g} s):"
    )
    print(f"  sequential           {tts['sequential']:7.2f} s  phases {phase_medians['sequential']}")
    print(f"  overlapped           {tts['overlapped']:7.2f} s  phases {phase_medians['overlapped']}")
    print(
        f"  longest phase        {tts['longest_phase']:7.2f} s  "
        f"(overlapped = {ratios['overlapped_over_longest_phase']:.2f} x longest)"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "first_step_s": first_step,
                    "tts_s": tts,
                    "ratios": ratios,
                    "phases_s": phase_medians,
                    "process_cpu_s": cpu,
                    "runs": {
                        v: [
                            {k: x for k, x in r.items() if k not in ("run_dir", "inductor_cache")} for r in rs
                        ]
                        for v, rs in runs.items()
                    },
                    "config": {
                        "layers": args.layers,
                        "runs": args.runs,
                        "data_warmup_s": args.data_warmup_s,
                        "ckpt_read_s": args.ckpt_read_s,
                        "ckpt_mb": args.ckpt_mb,
                        "wall_s": round(time.time() - began, 1),
                    },
                    "quick": args.quick,
                }
            )
        )


if __name__ == "__main__":
    main()

"""The training job's shutdown time with publishing inside the job vs standalone, side by side.

Runs the TorchRec DLRM reference model as a real job — `ettr run -- torchrun --nproc-per-node 2` — with
its embedding tables sharded over gloo (one row-wise, one column-wise, the rest table-wise), trains a few
steps, and ends it with `ettr.publish.publish_at_end` in each mode:

* `inside`: rank 0 builds the inference artifact before the job ends (rank 1 waits), as the source
  article's jobs did;
* `standalone`: the job writes the anchor checkpoint, enqueues the request and ends; `ettr publish`
  then builds the artifact in its own process (its time is reported as the publish job's).

The job's `shutdown` bucket (last training step -> job end, from `ettr report --json`) is compared; the
modes alternate within each repeat and the medians are printed. `--json` ends with one object:
inside_shutdown_s, standalone_shutdown_s, shutdown_ratio, saved_s_per_job, inside_publish_phase_s,
standalone_publish_phase_s (the training job's PUBLISH span: the build vs anchor + enqueue), publish_job_wall_s,
publish_job_work_s (its wall less the queue wait), inside_wall_s, standalone_wall_s, num_repeats.

    python benchmarks/publish_shutdown.py [--repeats 3] [--steps 20] [--json] [--quick]

`--quick` (what CI runs): one run of each mode, 5 steps, 4 tables of 2,000 rows.

`python benchmarks/publish_shutdown.py job ...` is the training job itself (what torchrun runs; the
publish tests run it too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PUBLISHER_ALLOWS = ("--allow-factory", "dlrm.model.*", "--allow-pythonpath", str(EXAMPLES))
"""What the publisher lets requests run: the example's model code (docs/trust.md)."""
ETTR = Path(sys.executable).with_name("ettr")


# -- the training job (one process per rank, under torchrun) -----------------------------------------------
def _build_sharded(model: Any, world_size: int, lr: float) -> tuple[Any, Any]:
    """Shard `model.sparse_arch` over the default group: t0 column-wise (each rank holds half of every row),
    t1 replicated (data-parallel), the rest table-wise. (Row-wise sharding needs CUDA in TorchRec.)"""
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    _apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": lr})
    num_tables = model.config.num_tables
    kinds = ["column_wise", "data_parallel"] + ["table_wise"] * max(0, num_tables - 2)
    constraints = {
        f"t{i}": ParameterConstraints(
            sharding_types=[kinds[i]], min_partition=model.config.embedding_dim // world_size
        )
        for i in range(num_tables)
    }
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world_size, local_world_size=world_size),
        kernel_config=KernelConfig(compute_device="cpu"),
    )
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    sharded = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(sharded.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=lr),
    )
    return sharded, CombinedOptimizer([sharded.fused_optimizer, dense_optimizer])


def run_job(args: argparse.Namespace) -> int:
    """Train the sharded DLRM for `--steps` steps, then publish at the end in `--mode`."""
    import warnings

    sys.path.insert(0, str(EXAMPLES))
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    import ettr
    from ettr.publish import ModelSpec, PublishConfig, publish_at_end

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with ettr.phase(ettr.Phase.PROCESS_GROUP_INIT):
        dist.init_process_group("gloo")
    with ettr.phase(ettr.Phase.TRAIN_MODULE_CREATION):
        from dlrm.data import ClickDataConfig, HiddenClickModel
        from dlrm.model import Dlrm, DlrmConfig
        from torchrec import KeyedJaggedTensor

        torch.manual_seed(args.seed)
        model_config = DlrmConfig(
            num_tables=args.num_tables, num_rows=args.num_rows, embedding_dim=32, bottom_mlp=(32, 32)
        )
        model = Dlrm(model_config, table_device=torch.device("meta"))
        sharded, optimizer = _build_sharded(model, world_size, lr=0.05)
    data = HiddenClickModel(
        ClickDataConfig(
            num_tables=args.num_tables, num_rows=args.num_rows, batch_size=args.batch_size, seed=args.seed
        )
    )
    keys = model_config.feature_names
    ettr.training_started()
    for step in range(1, args.steps + 1):
        batch = data.batch(rank=rank, index=step - 1)
        logits = sharded(
            batch.dense, KeyedJaggedTensor(keys=keys, values=batch.values, lengths=batch.lengths)
        )
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ettr.step(step)
    sample = data.batch(rank=rank, index=args.steps)
    spec = ModelSpec(
        factory="dlrm.model:Dlrm",
        config_type="dlrm.model:DlrmConfig",
        config=asdict(model_config),
        pythonpath=(str(EXAMPLES),),
    )
    config = PublishConfig(
        anchor_root=args.anchor_root,
        queue_dir=args.queue,
        model=spec,
        input_names=("dense", "sparse"),
        mode=args.mode,
        dtype=args.dtype,
    )
    result = publish_at_end(
        sharded,
        step=args.steps,
        config=config,
        sample_inputs=(
            sample.dense,
            KeyedJaggedTensor(keys=keys, values=sample.values, lengths=sample.lengths),
        ),
    )
    if rank == 0 and args.summary_out:
        Path(args.summary_out).write_text(json.dumps({**asdict(result), "plan": str(sharded.plan)}, indent=1))
    dist.destroy_process_group()
    return 0


# -- the benchmark -----------------------------------------------------------------------------------------
def _report(run_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        [str(ETTR), "report", str(run_dir), "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def one_run(work: Path, mode: str, index: int, args: argparse.Namespace) -> dict[str, Any]:
    """One supervised 2-rank job that publishes in `mode`; for standalone, then the publisher."""
    base = work / f"{mode}-{index}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    command = [
        str(ETTR), "run", "--run-dir", str(base / "run"), "--job-id", f"dlrm-{mode}-{index}", "--max-restarts", "0",
        "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world_size),
        str(Path(__file__).resolve()), "job", "--mode", mode, "--steps", str(args.steps),
        "--queue", str(base / "queue"), "--anchor-root", str(base / "anchor"), "--summary-out", str(base / "summary.json"),
        "--num-tables", str(args.num_tables), "--num-rows", str(args.num_rows),
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(
            f"the {mode} job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    report = _report(base / "run")
    row = {
        "mode": mode,
        "shutdown_s": report["buckets_s"]["shutdown"],
        "wall_s": report["wall_s"],
        "publish_phase_s": report.get("phases_s", {}).get("publish"),
    }
    if mode == "standalone":
        begin = time.time()
        out = subprocess.run(
            [str(ETTR), "publish", str(base / "queue"), "--json", *PUBLISHER_ALLOWS],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if out.returncode != 0:
            raise SystemExit(
                f"ettr publish failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
            )
        row["publisher_process_s"] = time.time() - begin
        summary = json.loads((base / "summary.json").read_text())
        publish = _report(Path(summary["publish_run_dir"]))
        row["publish_job_wall_s"] = publish["wall_s"]
        row["publish_job_work_s"] = publish["wall_s"] - publish["buckets_s"]["scheduling"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    job = sub.add_parser("job", help="the training job (run under torchrun)")
    job.add_argument("--mode", choices=("inside", "standalone"), required=True)
    job.add_argument("--steps", type=int, default=20)
    job.add_argument("--num-tables", type=int, default=6)
    job.add_argument("--num-rows", type=int, default=2000)
    job.add_argument("--batch-size", type=int, default=128)
    job.add_argument("--seed", type=int, default=0)
    job.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    job.add_argument("--queue", required=True)
    job.add_argument("--anchor-root", required=True)
    job.add_argument("--summary-out")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode (medians are printed)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per job")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--num-tables", type=int, default=8, help="embedding tables of the DLRM")
    parser.add_argument("--num-rows", type=int, default=20000, help="rows per table (8 x 20000 x 32 = 20 MB)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    parser.add_argument("--quick", action="store_true", help="one small run of each mode (CI's check)")
    args = parser.parse_args(argv)
    if args.cmd == "job":
        return run_job(args)
    if args.quick:
        args.repeats, args.steps, args.num_tables, args.num_rows = 1, 5, 4, 2000
    if args.repeats < 1 or args.steps < 1 or args.num_tables < 1 or args.num_rows < 1:
        parser.error("--repeats, --steps, --num-tables and --num-rows must be >= 1")

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ettr-publish-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for index in range(args.repeats):
        for mode in ("inside", "standalone") if index % 2 == 0 else ("standalone", "inside"):
            row = one_run(work, mode, index, args)
            rows.append(row)
            print(
                f"run {index} {mode:10s} shutdown {row['shutdown_s']:6.2f} s (publish phase "
                f"{row['publish_phase_s']:5.2f} s)  job wall {row['wall_s']:6.2f} s"
                + (
                    f"  publish job {row['publish_job_wall_s']:6.2f} s" if "publish_job_wall_s" in row else ""
                ),
                flush=True,
            )

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    inside, standalone = median("inside", "shutdown_s"), median("standalone", "shutdown_s")
    figures = {
        "inside_shutdown_s": inside,
        "standalone_shutdown_s": standalone,
        "shutdown_ratio": inside / standalone if standalone > 0 else None,
        "saved_s_per_job": inside - standalone,
        "publish_job_wall_s": median("standalone", "publish_job_wall_s"),
        "publish_job_work_s": median("standalone", "publish_job_work_s"),
        "inside_publish_phase_s": median("inside", "publish_phase_s"),
        "standalone_publish_phase_s": median("standalone", "publish_phase_s"),
        "inside_wall_s": median("inside", "wall_s"),
        "standalone_wall_s": median("standalone", "wall_s"),
        "num_repeats": args.repeats,
        "world_size": args.world_size,
        "quick": args.quick,
    }
    print(
        f"\ntraining job shutdown (median of {args.repeats}): inside {inside:.2f} s, standalone {standalone:.2f} s "
        f"-> {figures['shutdown_ratio']:.1f}x shorter, {figures['saved_s_per_job']:.2f} s saved per job; "
        f"publish phase inside the job {figures['inside_publish_phase_s']:.2f} s vs "
        f"{figures['standalone_publish_phase_s']:.2f} s (anchor + enqueue); "
        f"the publish job then took {figures['publish_job_work_s']:.2f} s on its own (process start included)"
    )
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())

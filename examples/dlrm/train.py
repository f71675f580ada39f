"""The reference TorchRec job: a DLRM on synthetic clicks, tables sharded over gloo, instrumented with ettr.

    torchrun --nproc-per-node 2 examples/dlrm/train.py --steps 300
    ettr run -- torchrun --nproc-per-node 2 examples/dlrm/train.py --steps 300 --ckpt-every 100

Start-up runs as the named init sub-stages, each an `ettr.phase`, with the init communication audit
(`ettr.audit`) counting the collectives of each:

    DEVICE_INIT -> PREPROC_CREATION -> PROCESS_GROUP_INIT -> TRAIN_MODULE_CREATION -> INIT_PLUGINS
    -> RESTORE (recorded by the checkpointer) -> PRE_TRAIN -> COMPILE -> GET_FIRST_BATCH_DATA
    -> training_started()

With `--overlap-startup` the loader workers start in PREPROC_CREATION, before the process group: their
warm-up runs while the ranks meet, build the model and restore. With `--inplace` (`ettr.resilient`) each
in-place restart is a generation: it makes its process group, model and checkpointer anew (they hold the
group), while the loader workers are kept and moved to the restored step (`dlrm.data.KeptLoader`).

The loop (global steps are 1-based; step n consumes batch n-1 of each rank's stream):

    for step in range(resumed_step + 1, steps + 1):
        loss = train_step(next(batches))   # embeddings are updated inside backward (fused), then the dense step
        ettr.step(step)
        checkpointer.after_step(step)      # saves on the interval: CHECKPOINT_BLOCKING, then the commit

Without `ettr run` (and without `--ettr-run-dir`) the ettr calls record nothing and cost nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

if __package__ in (None, ""):
    # Run as a script (torchrun examples/dlrm/train.py): make the `dlrm` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

import ettr
import ettr.audit
import ettr.inplace
import ettr.report.audit
from dlrm.checkpointing import AutoInterval, Checkpointer, make_checkpointer
from dlrm.data import ClickBatch, ClickDataConfig, KeptLoader, make_loader
from dlrm.plan_cache import PlanCache, plan_key
from ettr.errors import UsageError
from ettr.events import Event, EventKind


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything the job does, from the command line (see `--help` for each flag)."""

    steps: int = 300
    """Train until this global step."""
    batch_size: int = 512
    """Samples per step, per rank."""
    num_tables: int = 12
    """Embedding tables (one sparse feature each)."""
    num_rows: int = 4000
    """Rows per table."""
    embedding_dim: int = 32
    """Embedding width."""
    lr: float = 0.05
    """Learning rate of the dense Adagrad and of the fused row-wise Adagrad of the tables."""
    seed: int = 0
    """Seed of the data and of the model initialisation."""
    num_workers: int = 1
    """DataLoader worker processes per rank."""
    worker_startup_s: float = 1.5
    """Seconds a loader worker takes before its first batch."""
    compile: bool = True
    """torch.compile the dense tower (warmed up in the COMPILE phase before the loop)."""
    ckpt_every: int = 0
    """Checkpoint every this many steps (0: never)."""
    ckpt_mode: str = "sync"
    """`sync` (torch.save per rank, training waits) or `ettr` (the ettr checkpoint manager)."""
    ckpt_auto: bool = False
    """`ettr` mode: let the manager's `auto` interval choose when to save (from the measured save cost and
    the failure rate: `failures_per_day`, updated with the failures this job's ledger has seen) instead of
    every `ckpt_every` steps."""
    failures_per_day: float = 1.0
    """`--ckpt-auto`: the prior failure rate of jobs like this one, per day of wall time."""
    failure_prior_days: float = 1.0
    """`--ckpt-auto`: how many days of observation that prior is worth."""
    memory_interval: str | None = None
    """`ettr` mode: memory-tier commits between storage commits (`CheckpointConfig.memory_interval`: `auto`
    or seconds), so that a restore from memory (`--inplace`) loses at most that interval. None: off."""
    ckpt_dir: str = "checkpoints/dlrm"
    """Where checkpoints go and are resumed from."""
    resume: bool = True
    """Resume from the newest committed checkpoint in `ckpt_dir` if there is one."""
    publish: str = "none"
    """Inference publishing at the end: `inside` (this job builds the artifact), `standalone` (this job
    writes the anchor checkpoint and enqueues a request; `ettr publish <publish_dir>/queue` builds it in a
    job of its own), or `none`."""
    publish_dir: str = "publish/dlrm"
    """Where publishing keeps its anchor checkpoints (`anchors/`) and its queue (`queue/`)."""
    publish_anchor: str = "linked"
    """`linked`: the anchor is made from ettr's committed final checkpoint by hard links where it can be
    (written otherwise); `written`: always written (what `benchmarks/publish_anchor.py` compares against)."""
    compile_cache: str | None = None
    """Root of inductor's local caches, one fresh directory per attempt (`<root>/attempt-<ETTR_ATTEMPT>`, and
    `-<ETTR_SUPERVISOR_PID>` under `ettr run`: its cache directory and precompiled headers), as on a newly
    allocated machine: every attempt compiles cold unless ettr's compile store (`ETTR_COMPILE_STORE` under
    `ettr run`) restores the artifacts. None: the usual shared caches (warm after the first run on this
    machine)."""
    overlap_startup: bool = False
    """Start the loader workers first, before the process group and the model, so their start-up is hidden
    behind those (and keep them across in-place restarts)."""
    plan_cache: str | None = None
    """Directory of computed TorchRec sharding plans: the plan of this model and world size is computed
    (collectively) once, then read back by every later attempt and job (`dlrm.plan_cache`). None: plan
    at every start-up."""
    fast_exit: bool = False
    """After the final save is committed (and the anchor written), end the processes without tearing
    down what the job no longer needs (loader workers, process groups, TorchRec, the interpreter)."""
    inplace: bool = False
    """Restart in place (`ettr.resilient`): on a rank's failure the other ranks keep their processes, re-form the
    process group with its replacement and restore the last commit from memory (with `--ckpt-mode ettr`)."""
    log_every: int = 25
    """Print the mean loss every this many steps."""
    audit: bool = True
    """Count and time the start-up collectives (`ettr.audit`)."""
    ettr_run_dir: str | None = None
    """Record into this run directory without `ettr run` (ignored under `ettr run`)."""
    summary_out: str | None = None
    """Rank 0 writes a JSON summary (losses, step times, init timings) here at the end."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "num_tables", "num_rows", "embedding_dim", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.num_workers < 0 or self.ckpt_every < 0 or self.worker_startup_s < 0:
            raise ValueError("--num-workers, --ckpt-every and --worker-startup-s must be >= 0")
        if self.ckpt_mode not in ("sync", "ettr"):
            raise ValueError(f"--ckpt-mode must be sync or ettr, got {self.ckpt_mode!r}")
        if self.ckpt_auto and self.ckpt_mode != "ettr":
            raise ValueError("--ckpt-auto needs --ckpt-mode ettr (the auto interval is the ettr manager's)")
        if self.memory_interval is not None and self.ckpt_mode != "ettr":
            raise ValueError(
                "--memory-interval needs --ckpt-mode ettr (memory-tier commits are the ettr manager's)"
            )
        if not (self.failures_per_day > 0 and self.failure_prior_days > 0):
            raise ValueError("--failures-per-day and --failure-prior-days must be positive")
        if self.publish not in ("inside", "standalone", "none"):
            raise ValueError(f"--publish must be inside, standalone or none, got {self.publish!r}")
        if self.publish_anchor not in ("linked", "written"):
            raise ValueError(f"--publish-anchor must be linked or written, got {self.publish_anchor!r}")
        if self.compile_cache is not None:
            longest = Path(self.compile_cache).resolve() / "attempt-999-4194304" / "tmp"
            if len(os.fsencode(longest)) > SOCKET_TMP_MAX:
                raise ValueError(
                    f"--compile-cache {self.compile_cache!r} is too long: an attempt's temp directory under it "
                    f"({longest}) would be over the {SOCKET_TMP_MAX} bytes the loader's sockets fit under "
                    "(AF_UNIX paths); choose a shorter path"
                )


SOCKET_TMP_MAX = 72
"""The longest temp directory that multiprocessing's AF_UNIX sockets fit under: their addresses are
`TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX`, at most 107 bytes (the loader's workers share tensors through
them). `--compile-cache` moves TMPDIR under it (`use_attempt_compile_cache`)."""


def build_parser() -> argparse.ArgumentParser:
    """The command line; one flag per `TrainConfig` field."""
    parser = _OneLineErrorParser(prog="train.py", description=__doc__.split("\n\n")[0])
    d = TrainConfig()
    add = parser.add_argument
    add("--steps", type=int, default=d.steps, help="train until this global step")
    add("--batch-size", type=int, default=d.batch_size, help="samples per step, per rank")
    add("--num-tables", type=int, default=d.num_tables, help="embedding tables")
    add("--num-rows", type=int, default=d.num_rows, help="rows per table")
    add("--embedding-dim", type=int, default=d.embedding_dim, help="embedding width")
    add("--lr", type=float, default=d.lr, help="learning rate")
    add("--seed", type=int, default=d.seed, help="data and initialisation seed")
    add("--num-workers", type=int, default=d.num_workers, help="loader workers per rank")
    add(
        "--worker-startup-s", type=float, default=d.worker_startup_s, help="seconds to a worker's first batch"
    )
    add("--compile", action=argparse.BooleanOptionalAction, default=d.compile, help="compile the dense tower")
    add("--ckpt-every", type=int, default=d.ckpt_every, help="checkpoint every N steps (0: never)")
    add("--ckpt-mode", choices=("sync", "ettr"), default=d.ckpt_mode, help="how checkpoints are written")
    add(
        "--ckpt-auto", action=argparse.BooleanOptionalAction, default=d.ckpt_auto, help="auto interval (ettr)"
    )
    add("--failures-per-day", type=float, default=d.failures_per_day, help="--ckpt-auto: prior failure rate")
    add("--failure-prior-days", type=float, default=d.failure_prior_days, help="--ckpt-auto: prior's weight")
    add("--memory-interval", default=d.memory_interval, help="memory-tier commits: auto or seconds (ettr)")
    add("--ckpt-dir", default=d.ckpt_dir, help="checkpoint directory")
    add("--resume", action=argparse.BooleanOptionalAction, default=d.resume, help="resume from the latest")
    add("--publish", choices=("inside", "standalone", "none"), default=d.publish, help="inference publishing")
    add("--publish-dir", default=d.publish_dir, help="anchors/ and queue/ of publishing")
    add(
        "--publish-anchor",
        choices=("linked", "written"),
        default=d.publish_anchor,
        help="anchor from the checkpoint",
    )
    add("--compile-cache", default=d.compile_cache, help="root of per-attempt (cold) inductor caches")
    add("--overlap-startup", action=argparse.BooleanOptionalAction, default=d.overlap_startup)
    add("--plan-cache", default=d.plan_cache, help="directory of computed sharding plans (reused)")
    add("--fast-exit", action=argparse.BooleanOptionalAction, default=d.fast_exit, help="skip the teardown")
    add("--inplace", action=argparse.BooleanOptionalAction, default=d.inplace, help="restart in place")
    add("--log-every", type=int, default=d.log_every, help="print the loss every N steps")
    add("--audit", action=argparse.BooleanOptionalAction, default=d.audit, help="audit start-up collectives")
    add("--ettr-run-dir", default=d.ettr_run_dir, help="record here without `ettr run`")
    add("--summary-out", default=d.summary_out, help="rank 0 writes a JSON summary here")
    return parser


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one clear line and exit 2, not the usage block
        raise UsageError(message)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """`TrainConfig` from the command line. Raises `UsageError` on bad input."""
    args = vars(build_parser().parse_args(argv))
    try:
        config = TrainConfig(**args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return config


class StageClock:
    """`ettr.phase` plus a local stopwatch, so the job can print its own start-up breakdown."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, phase: ettr.Phase, **data: Any) -> Iterator[None]:
        begin = time.perf_counter()
        with ettr.phase(phase, **data):
            yield
        self.seconds[phase.value] = self.seconds.get(phase.value, 0.0) + time.perf_counter() - begin

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """A sub-part of a phase, timed locally only (e.g. the TorchRec import inside module creation)."""
        begin = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - begin


class TrainState:
    """Model and optimizer as one Stateful for the checkpointer (TorchRec's own sharded state_dicts)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])


def use_attempt_compile_cache(root: str | os.PathLike[str]) -> Path:
    """Point inductor's local caches at `root/attempt-<ETTR_ATTEMPT>[-<ETTR_SUPERVISOR_PID>]` and return that
    directory.

    Call before anything compiles: inductor reads TORCHINDUCTOR_CACHE_DIR when it compiles, and places its
    precompiled headers under the temp directory when `torch._inductor.codecache` is first imported (so
    TMPDIR moves too; workers and compile subprocesses inherit both). Per `ettr run` invocation as well as
    per attempt: a requeued job is on a newly allocated machine, whose caches nothing of the invocation
    before has filled (not even its parked spares, which carry the next attempt's number and restore the
    compile store's artifacts ahead for it: `ettr.compile.ahead`).
    """
    import tempfile

    name = f"attempt-{int(os.environ.get('ETTR_ATTEMPT', '0'))}"
    invocation = os.environ.get("ETTR_SUPERVISOR_PID", "")
    if invocation.isdigit():
        name += f"-{invocation}"
    directory = Path(root).resolve() / name
    (directory / "tmp").mkdir(parents=True, exist_ok=True)
    if "torch._inductor.codecache" in sys.modules:
        # A warm process (the zygote's worker, a standby) imported inductor ahead (`ettr.bootstrap.start.
        # TORCH_PARTS`); ettr's compile session moves its precompiled headers here at the first torch.compile.
        print("train.py: inductor was imported ahead (a warm start)", file=sys.stderr)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory / "inductor")
    os.environ["TMPDIR"] = str(directory / "tmp")
    tempfile.tempdir = None  # re-read TMPDIR at the next gettempdir()
    return directory


def leave_sigterm_to_the_trainer(worker_id: int) -> None:
    """Loader worker init: only the trainer's SIGTERM stops this worker, not a scheduler's.

    A scheduler's SIGTERM reaches every process of the job. A worker that dies of it makes the DataLoader
    raise in the trainer (its SIGCHLD handler, or the next batch that can no longer be received) before
    the trainer's preemption save can run. So SIGTERM is taken by a thread here: from the trainer (how
    the DataLoader and multiprocessing stop workers) it ends the worker at once; from anyone else it is
    ignored. A worker whose trainer is gone ends within a second.
    """
    trainer = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit the mask

    def take_sigterm() -> None:
        while True:
            info = signal.sigtimedwait({signal.SIGTERM}, 1.0)
            if (info is not None and info.si_pid == trainer) or os.getppid() != trainer:
                os._exit(0)

    threading.Thread(target=take_sigterm, name="sigterm", daemon=True).start()


def exit_now(status: int) -> NoReturn:
    """End the process at once, after a save committed the state (a preemption's, or the final one).

    A scheduler's grace period is for saving: tearing TorchRec, fbgemm and gloo down at interpreter exit
    takes seconds here. So compile artifacts not stored yet are stored, the recorder is flushed, and the
    process ends without that teardown; its loader workers are killed rather than stopped and joined
    (they would end on their own within a second, holding the job's output open until then). The same
    at the end of a job with `--fast-exit`, once the final state is committed.
    """
    import ettr.compile

    session = ettr.compile.current_session()
    if session is not None:
        session.close()
    import multiprocessing

    # The DataLoader's SIGCHLD handler raises in this thread when one of its workers dies of a signal: the
    # kills below ended a completed job with exit status 1 (one run in ~20 here, after its final commit).
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:  # not the main thread: no handler of the DataLoader's runs here either
        pass
    for child in multiprocessing.active_children():  # loader workers: nothing left for them to do
        child.kill()
    ettr.get_recorder().flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def print0(*args: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print("[dlrm]", *args, flush=True)


def init_process_group(rank: int, world_size: int) -> None:
    if "MASTER_ADDR" in os.environ:  # torchrun
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    else:  # a plain `python train.py`: one rank, no rendezvous needed
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def model_config(config: TrainConfig) -> Any:
    """The `DlrmConfig` of the job's model."""
    from dlrm.model import DlrmConfig

    return DlrmConfig(
        num_tables=config.num_tables,
        num_rows=config.num_rows,
        embedding_dim=config.embedding_dim,
        bottom_mlp=(64, config.embedding_dim),
    )


def publish(
    model: Any, *, step: int, config: TrainConfig, data: ClickDataConfig, rank: int, checkpoint: Any = None
) -> None:
    """Publish the trained model (collective; `config.publish` is `inside` or `standalone`).

    The sample batch is the one after the training stream, so the artifact is checked on unseen data.
    `checkpoint`: the committed checkpoint of `step` (ettr's checkpointer), which the anchor is made from
    by hard links instead of a second write of the model.
    """
    from torchrec import KeyedJaggedTensor

    from dlrm.data import HiddenClickModel
    from ettr.publish import ModelSpec, PublishConfig, publish_at_end

    sample = HiddenClickModel(data).batch(rank=rank, index=config.steps)
    spec = ModelSpec(
        factory="dlrm.model:Dlrm",
        config_type="dlrm.model:DlrmConfig",
        config=asdict(model_config(config)),
        pythonpath=(str(Path(__file__).resolve().parents[1]),),
    )
    root = Path(config.publish_dir)
    publish_config = PublishConfig(
        anchor_root=root / "anchors",
        queue_dir=root / "queue",
        model=spec,
        input_names=("dense", "sparse"),
        mode=config.publish,
    )
    features = KeyedJaggedTensor(keys=data.feature_names, values=sample.values, lengths=sample.lengths)
    # The reference outputs are one forward in eval mode without grad: the compiled dense tower would
    # recompile for it (its graphs are for training, grad mode on), ~1 s of shutdown for one batch.
    with torch.compiler.set_stance("force_eager"):
        result = publish_at_end(
            model,
            step=step,
            config=publish_config,
            sample_inputs=(sample.dense, features),
            checkpoint=checkpoint,
        )
    done = (
        f"artifact built in {result.artifact_dir}" if result.built else f"request {result.request_id} queued"
    )
    made = result.anchor_made + (f" ({result.anchor_fallback})" if result.anchor_fallback else "")
    print0(f"publish ({config.publish}): anchor {result.anchor_path} {made}; {done}")


def build_model(config: TrainConfig, world_size: int, clock: StageClock) -> tuple[Any, Any, torch.nn.Module]:
    """The sharded model, its combined optimizer, and its dense tower (to compile later). Collective."""
    with clock.part("torchrec_import"):
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
        from torchrec.optim import RowWiseAdagrad
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        from dlrm.model import Dlrm

    torch.manual_seed(config.seed)  # same dense init everywhere (DDP broadcasts rank 0's anyway)
    model = Dlrm(
        model_config(config),
        table_device=torch.device("meta"),  # the sharder allocates only this rank's shards
    )
    # Tables are trained by fbgemm's fused row-wise Adagrad inside backward (TorchRec's standard set-up).
    from torch.distributed.optim import _apply_optimizer_in_backward

    _apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": config.lr})
    dense_tower = model.dense_tower
    sharders = [EmbeddingBagCollectionSharder()]
    with clock.part("plan"):
        topology = TopologyFactory.create_topology(
            trainer_config=TrainerConfig(world_size=world_size, local_world_size=world_size),
            kernel_config=KernelConfig(compute_device="cpu"),
        )
        planner = EmbeddingShardingPlanner(topology=topology)
        cache = PlanCache(config.plan_cache, key=plan_key(model_config(config), world_size))
        plan = cache.load_agreed(world_size)
        if plan is None:  # computed once (collectively), then read back by every later start-up
            plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
            cache.store(plan, rank=int(os.environ.get("RANK", "0")))
    with clock.part("shard"):
        sharded = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(sharded.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=config.lr),
    )
    optimizer = CombinedOptimizer([sharded.fused_optimizer, dense_optimizer])
    return sharded, optimizer, dense_tower


def compile_dense_tower(dense_tower: torch.nn.Module, data: ClickDataConfig, embedding_dim: int) -> None:
    """Compile the dense tower in place and run it forward and backward once on the training shapes.

    In place (`Module.compile`), so the sharded model calls the compiled tower and state_dict keys stay
    unprefixed. The gradient is taken w.r.t. the input only, so no parameter gradient is accumulated and
    DDP's hooks do not fire; the graphs compiled here are the ones the loop uses (no recompile at step 1).
    Not earlier: `torch.compile` itself (inductor's set-up) took 4-5 s at load 12 when called at the model
    build, on the path of every start, and the compile store's restore it starts did not shorten this
    phase in exchange (measured in the full demo).
    """
    dense_tower.compile(dynamic=False)
    dense = torch.zeros(data.batch_size, data.num_dense)
    pooled = torch.zeros(data.batch_size, data.num_tables, embedding_dim, requires_grad=True)
    torch.autograd.grad(dense_tower(dense, pooled).sum(), pooled)


def train_step(model: Any, optimizer: Any, batch: ClickBatch, keys: list[str]) -> torch.Tensor:
    """One optimizer step on `batch`; returns the (detached) loss."""
    from torchrec import KeyedJaggedTensor

    features = KeyedJaggedTensor(keys=keys, values=batch.values, lengths=batch.lengths)
    logits = model(batch.dense, features)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def _num_compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return -1


def run(config: TrainConfig) -> int:
    """Start up, train to `config.steps`, shut down. Returns the exit status."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if config.compile_cache is not None:
        use_attempt_compile_cache(config.compile_cache)
    if config.ettr_run_dir and not os.environ.get("ETTR_RUN_DIR"):
        ettr.init(config.ettr_run_dir)
    recorder = ettr.get_recorder()
    audit = ettr.audit.start(recorder) if config.audit else None
    clock = StageClock()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # TorchRec's own, not actionable here
    data_config = ClickDataConfig(
        num_tables=config.num_tables,
        num_rows=config.num_rows,
        batch_size=config.batch_size,
        seed=config.seed,
        worker_startup_s=config.worker_startup_s,
    )

    with clock.phase(ettr.Phase.DEVICE_INIT):
        torch.manual_seed(config.seed)
    with clock.phase(ettr.Phase.PREPROC_CREATION):
        kept = None
        if config.overlap_startup:  # workers start now and warm up while the ranks meet and build the model
            kept = KeptLoader(
                data_config,
                rank=rank,
                stop=config.steps,
                num_workers=config.num_workers,
                worker_init_fn=leave_sigterm_to_the_trainer,
            )
    if config.inplace:
        # Each generation makes its process group (the wrapper), model and checkpointer anew; the loader
        # workers are this process's, kept across generations (they hold no process group).
        status = ettr.inplace.resilient(
            lambda gen: _generation(config, data_config, clock, audit, kept, gen.rank, gen.world_size)
        )()
    else:
        with clock.phase(ettr.Phase.PROCESS_GROUP_INIT):
            init_process_group(rank, world_size)
        status = _generation(config, data_config, clock, audit, kept, rank, world_size)
    if config.fast_exit:  # the state is committed and the books flushed: nothing left to wait for
        exit_now(status)
    return status


def _generation(
    config: TrainConfig,
    data_config: ClickDataConfig,
    clock: StageClock,
    audit: Any,
    kept: KeptLoader | None,
    rank: int,
    world_size: int,
) -> int:
    """From the model to the end of training over the process group there is (one generation of a job
    restarted in place, or the whole of one that is not). `kept`: loader workers started already."""
    if kept is not None and kept.rank != rank:  # a rank of another number in this generation
        kept.close()
        kept = None
    batches: Iterator[ClickBatch] | None = None
    with clock.phase(ettr.Phase.TRAIN_MODULE_CREATION):
        model, optimizer, dense_tower = build_model(config, world_size, clock)
        state = TrainState(model, optimizer)
    with clock.phase(ettr.Phase.INIT_PLUGINS):
        # Later: the publisher (--publish) is created here too. (ettr's compile store needs nothing here:
        # under `ettr run` the bootstrap restores and saves compile artifacts on its own.)
        checkpointer: Checkpointer | None = None
        if config.ckpt_every or config.resume:
            checkpointer = make_checkpointer(
                config.ckpt_mode,
                config.ckpt_dir,
                state,
                dense=dense_tower,
                every_steps=config.ckpt_every,
                rank=rank,
                world_size=world_size,
                auto=AutoInterval(
                    failures_per_day=config.failures_per_day, prior_days=config.failure_prior_days
                )
                if config.ckpt_auto
                else None,
                memory_interval=config.memory_interval,
            )
    with clock.part("restore"):  # the checkpointer records the RESTORE phase and RESUMED itself
        if checkpointer is not None and config.resume:
            resumed_step = checkpointer.restore() or 0
        else:
            resumed_step = 0
            ettr.resumed_from(None)
    with clock.phase(ettr.Phase.PRE_TRAIN):
        model.train()
        if kept is not None:
            batches = kept.batches(resumed_step)
        else:
            loader = make_loader(
                data_config, rank=rank, start=resumed_step, stop=config.steps, num_workers=config.num_workers
            )
            loader.worker_init_fn = leave_sigterm_to_the_trainer
        dist.barrier()  # all ranks enter the loop together (and the audit shows what that wait costs)
    if config.compile:
        with clock.phase(ettr.Phase.COMPILE):
            compile_dense_tower(dense_tower, data_config, config.embedding_dim)
    num_graphs_after_warm_up = _num_compiled_graphs()
    with clock.phase(ettr.Phase.GET_FIRST_BATCH_DATA):
        if batches is None:
            batches = iter(loader)
        first_batch = next(batches, None)
    audit_summary = audit.finish() if audit is not None else None
    _print_start_up(clock, resumed_step, audit_summary, rank)

    ettr.training_started()
    keys = data_config.feature_names
    losses: list[float] = []
    step_s: list[float] = []
    # this thread's CPU in each step: against step_s, how much of a step waited for a core
    step_cpu_s: list[float] = []
    window: list[float] = []
    step = resumed_step
    batch = first_batch
    while batch is not None and step < config.steps:
        begin, begin_cpu = time.perf_counter(), time.thread_time()
        loss = train_step(model, optimizer, batch, keys)
        step += 1
        ettr.step(step)
        step_s.append(time.perf_counter() - begin)
        step_cpu_s.append(time.thread_time() - begin_cpu)
        window.append(float(loss))
        if step % config.log_every == 0 or step == config.steps:
            losses.append(statistics.fmean(window))
            print0(
                f"step {step}/{config.steps} loss {losses[-1]:.4f} step {1000 * statistics.median(step_s[-len(window) :]):.1f} ms"
            )
            window = []
        if checkpointer is not None:
            try:
                checkpointer.after_step(step)  # saves on the interval (ettr: also on SIGTERM, then exits 143)
            except SystemExit as stop:  # preempted, and the state of `step` is committed
                exit_now(stop.code if isinstance(stop.code, int) else 1)
        batch = next(batches, None)

    with clock.phase(ettr.Phase.SHUTDOWN):
        if checkpointer is not None:
            if (config.ckpt_every or config.ckpt_auto) and step > resumed_step:
                checkpointer.save(step)  # the final state (a no-op if the interval just saved it)
            checkpointer.close()
        if config.publish != "none" and step == config.steps:
            linked = checkpointer is not None and config.publish_anchor == "linked"
            committed = checkpointer.committed(step) if linked else None
            publish(model, step=step, config=config, data=data_config, rank=rank, checkpoint=committed)
        if not config.fast_exit:
            del batches  # stops the loader workers (and waits for them)
            if kept is not None:
                kept.close()
        summary = {
            "rank": rank,
            "world_size": world_size,
            "resumed_step": resumed_step,
            "last_step": step,
            "window_losses": losses,
            "median_step_s": statistics.median(step_s) if step_s else None,
            "median_step_cpu_s": statistics.median(step_cpu_s) if step_cpu_s else None,
            "init_s": clock.seconds,
            "num_compiled_graphs_after_warm_up": num_graphs_after_warm_up,
            "num_compiled_graphs_at_end": _num_compiled_graphs(),
            "audit": {k: v for k, v in (audit_summary or {}).items() if k != "calls"},
            "config": asdict(config),
        }
        if step_s:
            print0(
                f"done: steps {resumed_step + 1}..{step}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                f"median step {1000 * summary['median_step_s']:.1f} ms "
                f"(this thread's CPU {1000 * summary['median_step_cpu_s']:.1f} ms of it)"
            )
        if rank == 0 and config.summary_out:
            Path(config.summary_out).parent.mkdir(parents=True, exist_ok=True)
            Path(config.summary_out).write_text(json.dumps(summary, indent=2))
        if config.fast_exit:
            dist.barrier()  # no rank leaves while a peer still needs it in a collective
        elif not config.inplace:  # (the wrapper tears its own process groups down)
            dist.destroy_process_group()
    return 0


def _print_start_up(
    clock: StageClock, resumed_step: int, audit_summary: dict[str, Any] | None, rank: int
) -> None:
    if rank != 0:
        return
    parts = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in clock.seconds.items())
    # CPU seconds too: on a shared, loaded node the wall times above swing with the load, these much less.
    # (Subprocesses: the ones waited for, e.g. inductor's ISA probe and compiler runs; not loader workers.)
    cpu = os.times()
    print0(
        f"start-up: {parts}; cpu {cpu.user + cpu.system:.2f}s, subprocesses {cpu.children_user + cpu.children_system:.2f}s"
    )
    print0(f"resumed from step {resumed_step}" if resumed_step else "starting from scratch")
    if audit_summary is not None:
        event = Event(
            EventKind.MARK, time.time(), rank=rank, data={"name": ettr.audit.MARK_NAME, **audit_summary}
        )
        print(ettr.report.audit.render([event]), flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except UsageError as exc:
        print(f"train.py: {exc}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as failure:
        # Fail fast: this rank is done for (often a peer died and a collective broke). Record and print
        # the failure, then end without the seconds of interpreter teardown, so the supervisor sees it at
        # once. (torchrun's SIGTERM to the survivors would do that too, but the ettr checkpoint manager
        # takes SIGTERM as a preemption notice.)
        ettr.get_recorder().failure(failure)
        traceback.print_exc()
        exit_now(1)

"""The zero-code bootstrap: post-import hooks, sitecustomize selection and chaining, and the torch hooks
(installed in this process on a real recorder, then removed again)."""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ettr import post_import
from ettr.bootstrap import pythonpath_dir
from ettr.bootstrap.start import is_training_process
from ettr.events import Event, EventKind, Phase
from ettr.ledger import open_ledger
from ettr.recorder import Recorder

torch = pytest.importorskip("torch")
# Imported before any test's hooks: a module that a test imports later runs the post-import callbacks of every
# `AutoHooks` an earlier test made (one per process in real life), and the first one's wrapper would stay.
pytest.importorskip("torch.distributed.optim")


# -- post-import hooks -------------------------------------------------------------------------------------
def test_callback_runs_after_the_module_body_and_a_failing_one_does_not_break_the_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ettr_probe_mod.py").write_text("VALUE = 41\nVALUE += 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[Any] = []

    def broken(module: Any) -> None:
        raise RuntimeError("bug in a hook")

    post_import.when_imported("ettr_probe_mod", broken)
    post_import.when_imported("ettr_probe_mod", lambda m: seen.append(m.VALUE))
    try:
        import ettr_probe_mod  # type: ignore[import-not-found]

        assert seen == [42] and ettr_probe_mod.VALUE == 42
        assert ettr_probe_mod.__loader__.__class__.__name__ == "SourceFileLoader"  # the real loader
        # nothing watches the module any more (the finder leaves sys.meta_path once nothing is watched; names
        # another test of this process registered, such as a module it never imported, may keep it there)
        assert not any(
            "ettr_probe_mod" in f.watched
            for f in sys.meta_path
            if isinstance(f, post_import._PostImportFinder)
        )
        finder = post_import._finder
        assert finder is None or (finder in sys.meta_path and finder.watched)
        post_import.when_imported("ettr_probe_mod", lambda m: seen.append("again"))  # already imported
        assert seen == [42, "again"]
    finally:
        sys.modules.pop("ettr_probe_mod", None)


def test_a_lookup_before_the_import_does_not_use_up_the_callbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers and datasets ask `importlib.util.find_spec("torch")` whether torch is installed before they
    import it: the lookup took the callbacks, the import ran none, and a script that imported transformers
    before torch had none of the torch hooks (HF's run_classification.py: no `imports_done`; a plain loop after
    `import transformers`: 0 steps recorded)."""
    import importlib.util

    (tmp_path / "ettr_probe_lookup.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[Any] = []
    post_import.when_imported("ettr_probe_lookup", lambda m: seen.append(m.VALUE))
    try:
        assert importlib.util.find_spec("ettr_probe_lookup") is not None and seen == []
        assert importlib.util.find_spec("ettr_probe_lookup") is not None and seen == []
        import ettr_probe_lookup  # type: ignore[import-not-found]  # noqa: F401

        assert seen == [7]
        assert not any(
            "ettr_probe_lookup" in f.watched
            for f in sys.meta_path
            if isinstance(f, post_import._PostImportFinder)
        )
    finally:
        sys.modules.pop("ettr_probe_lookup", None)


# -- which processes are instrumented ---------------------------------------------------------------------
def test_only_training_processes_are_instrumented() -> None:
    run = {"ETTR_RUN_DIR": "/tmp/run"}
    assert is_training_process(run, 10)
    assert not is_training_process({}, 10)
    assert not is_training_process({**run, "ETTR_INSTRUMENTED_PID": "9"}, 10)  # a worker of rank 0
    assert is_training_process({**run, "ETTR_INSTRUMENTED_PID": "10"}, 10)  # the same process, exec'd again
    torchrun = {**run, "ETTR_LAUNCHER": "torchrun"}
    assert not is_training_process(torchrun, 10)  # the torchrun agent
    assert is_training_process({**torchrun, "TORCHELASTIC_RUN_ID": "x"}, 10)  # its workers


def _python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_sitecustomize_chains_the_one_it_hides_and_costs_nothing_outside_a_run(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.CHAINED = 'yes'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env["PYTHONPATH"] = f"{pythonpath_dir()}{os.pathsep}{other}"
    done = _python("import sys, builtins; print(builtins.CHAINED, 'ettr' in sys.modules)", env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["yes", "False"]


def test_sitecustomize_instruments_the_training_process_but_not_its_children(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(
        PYTHONPATH=str(pythonpath_dir()), ETTR_RUN_DIR=str(run_dir), ETTR_ATTEMPT="3", ETTR_AUTO="1", RANK="0"
    )
    code = textwrap.dedent(
        """
        import os, subprocess, sys
        print(os.environ["ETTR_INSTRUMENTED_PID"] == str(os.getpid()), "torch" in sys.modules)
        subprocess.run([sys.executable, "-c", "import sys; print('ettr' in sys.modules)"], check=True)
        raise ValueError("boom")
        """
    )
    done = _python(code, env, tmp_path)
    assert done.returncode == 1 and "ValueError: boom" in done.stderr
    assert done.stdout.split() == ["True", "False", "False"]  # torch not imported by the bootstrap
    events = open_ledger(run_dir).read()
    starts = [e for e in events if e.kind is EventKind.PROCESS_START]
    assert len(starts) == 1 and starts[0].attempt == 3
    failures = [e.data for e in events if e.kind is EventKind.FAILURE]
    assert failures == [{"exception": "ValueError", "message": "boom"}]  # the excepthook recorded it
    assert list((run_dir / "heartbeats" / "attempt-3").iterdir())


@pytest.mark.parametrize("fails", [True, False])
def test_a_torchrun_worker_that_fails_ends_without_the_interpreter_teardown(
    tmp_path: Path, fails: bool
) -> None:
    """Every launcher above it waited for that teardown (seconds under load); an ordinary exit keeps it."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env.update(
        PYTHONPATH=str(pythonpath_dir()), ETTR_RUN_DIR=str(run_dir), ETTR_ATTEMPT="0", ETTR_AUTO="0",
        ETTR_LAUNCHER="torchrun", TORCHELASTIC_RUN_ID="none", RANK="1",
    )  # fmt: skip
    env["PYTHONPATH"] += os.pathsep + str(Path(__file__).resolve().parents[1] / "src")  # this ettr
    torn_down = tmp_path / "torn-down"
    code = textwrap.dedent(
        f"""
        class Teardown:
            def __del__(self, open=open):  # builtins are gone by then
                open({str(torn_down)!r}, "w").close()
        keep = Teardown()  # freed only by the interpreter's teardown
        print("last words", flush=False)
        if {fails}:
            raise ValueError("boom")
        """
    )
    done = _python(code, env, tmp_path)
    assert done.stdout == "last words\n"  # flushed before the early end
    events = open_ledger(run_dir).read()
    agent = run_dir / "agent" / "attempt-0"
    if fails:
        assert done.returncode == 1 and "ValueError: boom" in done.stderr
        assert not torn_down.exists()  # no teardown
        assert [e.data["exception"] for e in events if e.kind is EventKind.FAILURE] == ["ValueError"]
        assert [p.name.split("-")[0] for p in agent.iterdir()] == ["failed"]
    else:
        assert done.returncode == 0 and torn_down.exists()
        assert [p.name.split("-")[0] for p in agent.iterdir()] == ["exited"]


# -- the torch hooks, in this process --------------------------------------------------------------------
@pytest.fixture
def hooked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Recorder, Any]]:
    from ettr.bootstrap.hooks import AutoHooks

    compile_calls: list[Any] = []
    try:
        import ettr.compile

        monkeypatch.setattr(ettr.compile, "autoinstall", compile_calls.append)
    except ImportError:
        pass
    # Another test of this process may have compiled something with Dynamo, after which evaluations are not
    # timed (`EvalHooks._hookable`): these tests start from a process that compiled nothing.
    from ettr import torch_compat

    monkeypatch.setattr(torch_compat, "dynamo_frames_compiled", lambda: 0)
    run_dir = tmp_path / "run"
    ledger = open_ledger(run_dir)
    earlier = tmp_path / "earlier.pt"
    torch.save({"w": torch.zeros(2)}, earlier)
    # attempt 0 committed step 5 a minute ago (a time near the others: the books skip one decades away)
    ledger.append(
        [Event(EventKind.CHECKPOINT_COMMIT, time.time() - 60, 0, 0, step=5, data={"path": str(earlier)})]
    )
    rec = Recorder(ledger, run_dir=run_dir, attempt=1, rank=0)
    hooks = AutoHooks(rec)
    hooks.on_torch(torch)
    hooks.compile_calls = compile_calls
    original_save = torch.save
    try:
        yield hooks, rec, ledger
    finally:
        hooks.uninstall()
        rec.close()
        assert torch.save is not original_save and not hasattr(torch.save, "__ettr_original__")


def _events(rec: Recorder, ledger: Any, kinds: set[EventKind] | None = None) -> list[Event]:
    rec.flush()
    return [e for e in ledger.read() if e.rank >= 0 and (kinds is None or e.kind in kinds)]


def test_an_unmodified_loop_is_recorded(hooked: tuple[Any, Recorder, Any], tmp_path: Path) -> None:
    hooks, rec, ledger = hooked
    if hooks.compile_calls:
        assert hooks.compile_calls == [rec]  # compile support installed on the same recorder
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)

    torch.load(tmp_path / "earlier.pt")  # resume: matches attempt 0's commit of step 5
    torch.load(tmp_path / "earlier.pt")  # loading it again resumes nothing more
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    for (x,) in loader:
        model(x).sum().backward()
        optimizer.step()
        other.step()  # a second optimizer steps in lockstep: not counted again
    list(loader)  # the second epoch's first batch is not a start-up wait
    ckpt = tmp_path / "ckpt" / "step-7.pt"
    ckpt.parent.mkdir()
    torch.save(model.state_dict(), ckpt)
    torch.save(model.state_dict(), io.BytesIO())  # serialization, not a checkpoint
    torch.save(model.state_dict(), str(ckpt) + ".tmp")
    os.replace(str(ckpt) + ".tmp", tmp_path / "ckpt" / "latest.pt")  # committed where it lands
    torch.load(ckpt)  # after training started, an unmatched load is the script's business

    events = _events(rec, ledger)
    resumed = [e.step for e in events if e.kind is EventKind.RESUMED]
    steps = [e.step for e in events if e.kind is EventKind.STEP]
    spans = [(e.phase, e.step) for e in events if e.kind is EventKind.PHASE_END]
    commits = [(e.step, Path(e.data["path"]).name) for e in events if e.kind is EventKind.CHECKPOINT_COMMIT]
    assert resumed == [5]
    assert steps == [6, 7]
    assert spans == [
        (Phase.RESTORE, 5),
        (Phase.RESTORE, 5),
        (Phase.GET_FIRST_BATCH_DATA, None),
        (Phase.CHECKPOINT_BLOCKING, 7),
        (Phase.CHECKPOINT_BLOCKING, 7),
    ]
    assert commits == [(5, "earlier.pt"), (7, "step-7.pt")]  # one checkpoint of step 7, three files
    # A resume from a file restored from storage: the report's `(restored from)` says so, not `?`.
    sources = [
        e.data.get("source") for e in events if e.kind is EventKind.PHASE_END and e.phase is Phase.RESTORE
    ]
    assert sources == ["storage", "storage"]
    files = [
        (e.data["step"], Path(e.data["path"]).name)
        for e in events
        if e.kind is EventKind.MARK and e.data.get("name") == "checkpoint_file"  # not imports_done
    ]
    assert files == [(7, "step-7.pt.tmp"), (7, "latest.pt")]
    # After the first batch the first-batch hook is gone: what is left is the loader passes' wrapper
    # (`loader_eval`) around the DataLoader's own method.
    base = torch.utils.data.dataloader._BaseDataLoaderIter
    assert base.__next__.__code__.co_filename.endswith("loader_eval.py")
    assert not hasattr(base.__next__.__ettr_original__, "__ettr_original__")


def test_a_save_lasts_until_the_save_function_returns_to_the_loop(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    # pytorch/examples imagenet's save_checkpoint: torch.save, then shutil.copyfile to model_best.pth. The copy
    # was booked as training; the loop's own next step must not be booked as checkpointing either.
    import shutil

    hooks, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ends: dict[str, float] = {}

    def _write(state: Any, path: Path) -> None:  # a helper of the save function: climbed over
        torch.save(state, path)

    def save_checkpoint(state: Any, path: Path) -> None:
        _write(state, path)
        shutil.copyfile(path, tmp_path / "model_best.pth")
        (tmp_path / "meta.json").write_text("{}")
        ends["function"] = time.time()

    def step() -> None:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    torch.save(
        model.state_dict(), tmp_path / "init.pt"
    )  # before the first step: no loop known, the call only
    ends["init"] = time.time()
    for i in range(4):
        step()
        if i == 1:
            save_checkpoint(model.state_dict(), tmp_path / "ckpt.pt")
            ends["returned"] = time.time()
        if i == 2:
            torch.save(model.state_dict(), tmp_path / "inline.pt")  # in the loop's own frame: the call only
            ends["inline"] = time.time()
    assert sys.getprofile() is None  # the window's profile function is gone

    events = _events(rec, ledger)
    spans = {
        Path(e.data["path"]).name: (e.value, e.ts)
        for e in events
        if e.kind is EventKind.PHASE_END and e.phase is Phase.CHECKPOINT_BLOCKING
    }
    steps = {e.step: e.ts for e in events if e.kind is EventKind.STEP}
    assert sorted(spans) == ["ckpt.pt", "init.pt", "inline.pt"]
    begin, end = spans["ckpt.pt"]
    assert ends["function"] <= end <= ends["returned"]  # the copy and the JSON are the save's
    assert steps[2] <= begin and end <= steps[3]
    assert spans["init.pt"][1] <= ends["init"] and spans["inline.pt"][1] <= ends["inline"]
    commits = [Path(e.data["path"]).name for e in events if e.kind is EventKind.CHECKPOINT_COMMIT]
    assert commits[-3:] == ["init.pt", "ckpt.pt", "inline.pt"]


def test_a_save_made_by_a_handler_inside_another_save_is_committed(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    # A SIGTERM-saving script behind a wrapper gets two SIGTERMs (the group's and torchrun's forward): the
    # second runs the handler again inside the first handler's torch.save; that inner save completes, then
    # sys.exit unwinds the outer one. The inner one was not recorded: the job lost the steps it saved.
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 2)).sum().backward()
    optimizer.step()

    def on_sigterm() -> None:
        torch.save(model.state_dict(), tmp_path / "inner.pt")
        raise SystemExit(0)

    class SecondSignal:  # the second SIGTERM, landing while the first save pickles
        def __reduce__(self) -> Any:
            on_sigterm()
            return (dict, ())

    with pytest.raises(SystemExit):
        torch.save({"model": model.state_dict(), "x": SecondSignal()}, tmp_path / "outer.pt")

    events = _events(rec, ledger)
    commits = [(e.step, Path(e.data["path"]).name) for e in events if e.kind is EventKind.CHECKPOINT_COMMIT]
    assert commits[-1] == (1, "inner.pt")
    spans = [
        (Path(e.data["path"]).name, e.data.get("error"))
        for e in events
        if e.kind is EventKind.PHASE_END and e.phase is Phase.CHECKPOINT_BLOCKING
    ]
    assert sorted(spans, key=str) == [("inner.pt", None), ("outer.pt", "SystemExit")]
    assert not hooks.checkpoints._busy() and sys.getprofile() is None


def test_a_save_window_ends_where_training_resumes_and_a_handler_is_its_own_save_function() -> None:
    from ettr.bootstrap.save_window import SaveWindow

    booked: list[tuple[float, float, int, str]] = []
    window = SaveWindow(lambda b, e, s, p: booked.append((b, e, s, p)))

    def loop_step() -> None:
        window.loop.at_step()

    def handler() -> None:  # a SIGTERM handler that saves, then lets the loop go on
        window.saved(1.0, 7, "ckpt.pt", sys._getframe())
        assert window.is_open  # its rest is the save's
        ends.append(time.time())

    ends: list[float] = []
    loop_step()
    handler()
    after = time.time()
    assert not window.is_open and booked[0][2:] == (7, "ckpt.pt")
    assert ends[0] <= booked[0][1] <= after
    # a window the save function never returns from is closed by the next backward pass / step / evaluation
    window.loop.renew()
    loop_step()

    def save_and_keep_going() -> None:
        window.saved(2.0, 8, "next.pt", sys._getframe())
        assert window.is_open
        window.close(end_ts=3.0)  # what CheckpointHooks.training_resumes does
        assert sys.getprofile() is None

    save_and_keep_going()
    assert booked[1] == (2.0, 3.0, 8, "next.pt")


def test_steps_follow_the_optimizer_that_steps_most_often(hooked: tuple[Any, Recorder, Any]) -> None:
    # dcgan: D then G every iteration (one step each, at D's); an optimizer stepped every 3rd iteration that
    # stepped first; a critic stepped 3 times per generator step; an optimizer made anew for a second phase.
    hooks, rec, ledger = hooked
    d_net, g_net = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

    def sgd(module: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=0.1)

    def update(opt: torch.optim.Optimizer, module: torch.nn.Module) -> None:
        opt.zero_grad()
        module(torch.randn(2, 2)).sum().backward()
        opt.step()

    def recorded() -> list[int | None]:
        return [e.step for e in _events(rec, ledger, {EventKind.STEP})]

    opt_d, opt_g = sgd(d_net), sgd(g_net)
    for _ in range(3):  # dcgan's iteration
        update(opt_d, d_net)
        update(opt_g, g_net)
    assert recorded() == [1, 2, 3]  # one step per iteration
    aux = sgd(torch.nn.Linear(2, 1))
    for i in range(6):  # an auxiliary optimizer every 3rd iteration, stepping before the main one
        if i % 3 == 0:
            update(aux, d_net)
        update(opt_g, g_net)
    assert recorded() == list(range(1, 10))  # one per iteration still
    for _ in range(2):  # WGAN: 3 critic steps per generator step, the generator counted last
        for _ in range(3):
            update(opt_d, d_net)
        update(opt_g, g_net)
    # The critic takes over at its second step without the generator; its first counts too: it comes back after
    # the generator stepped twice without it (each critic step is a step, as in a job that runs WGAN throughout).
    assert recorded()[-1] == 9 + 6
    phase_two = sgd(g_net)  # a new optimizer; the old ones are dropped
    del opt_d, opt_g, aux
    gc.collect()  # the counted optimizer is gone: the new one counts at once
    for _ in range(2):
        update(phase_two, g_net)
    assert recorded()[-2:] == [16, 17]


def test_dcp_priming_a_fresh_optimizer_is_not_a_step(hooked: tuple[Any, Recorder, Any]) -> None:
    """`get_state_dict` / `set_state_dict` (ettr's checkpoint manager saves and restores with them) step a
    fresh optimizer once with zero gradients to make its state: not a training step. It was booked as step 1
    during a restarted process's restore, before it trained."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    hooks, rec, ledger = hooked
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model_state, optim_state = get_state_dict(model, opt)  # primes `opt`: one optimizer.step()
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    set_state_dict(model, fresh, model_state_dict=model_state, optim_state_dict=optim_state)
    assert _events(rec, ledger, {EventKind.STEP}) == []
    fresh.zero_grad()
    model(torch.randn(2, 2)).sum().backward()
    fresh.step()  # the first training step is step 1
    assert [e.step for e in _events(rec, ledger, {EventKind.STEP})] == [1]


def test_a_distributed_optimizer_step_is_one_step_and_its_rpc_driven_local_steps_none(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    """torch.distributed.rpc's parameter-server training (pytorch/examples' ddp_rpc): the loop calls
    `DistributedOptimizer.step(context_id)`, which steps each owner's local optimizer through RPC: a functional
    one (SGD: TorchScript, no `torch.optim` step at all; the job showed no training step, ETT unknown) or a
    `torch.optim` one stepped on an RPC thread (NAdam here), which is no step of the owner's loop."""
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    hooks, rec, ledger = hooked
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp_path / 'rpc-store'}", rpc_timeout=120)
    rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=options)
    try:
        model = torch.nn.Linear(2, 1)
        for optimizer_class in (torch.optim.SGD, torch.optim.NAdam):
            opt = DistributedOptimizer(optimizer_class, [rpc.RRef(p) for p in model.parameters()], lr=0.1)
            for _ in range(3):
                with dist_autograd.context() as context_id:
                    dist_autograd.backward(context_id, [model(torch.randn(4, 2)).sum()])
                    opt.step(context_id)
    finally:
        rpc.shutdown()
    assert [e.step for e in _events(rec, ledger, {EventKind.STEP})] == list(range(1, 7))


def test_a_second_phase_optimizer_that_takes_over_loses_no_step(hooked: tuple[Any, Recorder, Any]) -> None:
    # A warm-up optimizer, then a new one for the rest while the first is still referenced (a scheduler, a
    # list of optimizers): 5 + 7 optimizer steps read 11 when the newcomer's first step was taken for the
    # partner in lockstep of the warm-up's last one.
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(2, 1)

    def run(opt: torch.optim.Optimizer, num_steps: int) -> None:
        for _ in range(num_steps):
            opt.zero_grad()
            model(torch.randn(2, 2)).sum().backward()
            opt.step()

    warmup = torch.optim.SGD(model.parameters(), lr=0.1)
    run(warmup, 5)
    main_phase = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run(main_phase, 7)
    assert [e.step for e in _events(rec, ledger, {EventKind.STEP})] == list(range(1, 13))
    assert warmup is not None  # kept alive to the end, as the field's script did


def test_optimizers_stepped_in_turn_lose_no_step_when_they_come_back(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    # Lightning's examples/fabric/kfold_cv: one model and optimizer per fold, each epoch trains every fold's
    # model in turn over its loader. In the second epoch each fold's optimizer comes back, and its first step
    # was taken for the partner in lockstep of the previous fold's last one: 75 steps of 80 were recorded.
    hooks, rec, ledger = hooked
    models = [torch.nn.Linear(2, 1) for _ in range(3)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for _ in range(2):  # epochs
        for model, opt in zip(models, optimizers, strict=True):  # folds
            for _ in range(4):
                opt.zero_grad()
                model(torch.randn(2, 2)).sum().backward()
                opt.step()
    assert [e.step for e in _events(rec, ledger, {EventKind.STEP})] == list(range(1, 25))


def test_a_loop_that_updates_its_weights_itself_steps_once_per_backward_pass(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    # pytorch/examples' word_language_model (its default): no optimizer, `p.data.add_(p.grad, alpha=-lr)`,
    # a per-epoch evaluate() and a torch.save(model) of the best one. It read "ETT 0.0%, init 99.9%".
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)

    def train_step() -> None:
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)

    for _ in range(3):
        train_step()
    assert [e.step for e in _events(rec, ledger, {EventKind.STEP})] == [1, 2]  # step 3's waits for its update
    model.eval()  # the evaluation settles step 3 first, and is one: its parameters hold gradients
    with torch.no_grad():
        model(torch.randn(2, 4))
    torch.save(model.state_dict(), tmp_path / "best.pt")
    model.train()
    train_step()
    torch.save(model.state_dict(), tmp_path / "step4.pt")  # a save right after an update holds that step

    events = _events(rec, ledger)
    steps = [e.step for e in events if e.kind is EventKind.STEP]
    kinds = [(e.kind, e.phase) for e in events if e.kind in (EventKind.STEP, EventKind.PHASE_BEGIN)]
    commits = [
        (e.step, Path(e.data["path"]).name)
        for e in events
        if e.kind is EventKind.CHECKPOINT_COMMIT and e.attempt == rec.attempt  # not the fixture's attempt 0
    ]
    assert steps == [1, 2, 3, 4]
    assert kinds.index((EventKind.PHASE_BEGIN, Phase.EVAL)) == 3  # after step 3
    assert commits == [(3, "best.pt"), (4, "step4.pt")]
    # Once the script builds an optimizer, its steps count on and backward passes are no steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    assert [e.step for e in _events(rec, ledger, {EventKind.STEP})] == [1, 2, 3, 4, 5, 6]


def test_explicit_steps_take_precedence_and_a_broken_hook_never_breaks_the_call(
    hooked: tuple[Any, Recorder, Any], tmp_path: Path
) -> None:
    hooks, rec, ledger = hooked
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()
    rec.step(100)  # the script calls ettr.step itself from here on
    optimizer.step()

    class Broken:
        num_steps = 0

        @property
        def current_step(self) -> int:
            raise RuntimeError("bug")

    hooks.checkpoints.steps = Broken()
    target = tmp_path / "still-saved.pt"
    torch.save({"x": 1}, target)
    assert torch.load(target) == {"x": 1}
    with pytest.raises(FileNotFoundError):
        torch.load(tmp_path / "missing.pt")  # the user's own errors still reach the user
    events = _events(rec, ledger, {EventKind.STEP, EventKind.CHECKPOINT_COMMIT})
    assert [(e.kind, e.step) for e in events] == [
        (EventKind.CHECKPOINT_COMMIT, 5),
        (EventKind.STEP, 1),
        (EventKind.STEP, 100),
    ]


def test_process_group_init_is_timed(hooked: tuple[Any, Recorder, Any], tmp_path: Path) -> None:
    hooks, rec, ledger = hooked
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    spans = [e for e in _events(rec, ledger, {EventKind.PHASE_END}) if e.phase is Phase.PROCESS_GROUP_INIT]
    assert len(spans) == 1 and spans[0].value is not None and spans[0].ts >= spans[0].value


def test_dcp_saves_and_loads_are_checkpoints(hooked: tuple[Any, Recorder, Any], tmp_path: Path) -> None:
    hooks, rec, ledger = hooked
    import torch.distributed.checkpoint as dcp

    hooks.on_dcp(dcp)  # the bootstrap calls this when dcp is first imported
    state = {"w": torch.ones(3)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp-0"), no_dist=True)
    future = dcp.async_save(state, checkpoint_id=str(tmp_path / "dcp-1"), no_dist=True)
    getattr(future, "upload_completion", future).result(timeout=60)
    # The commit is recorded by the future's done-callback, which runs after result() has returned to us.
    deadline = time.monotonic() + 60
    while not any(
        (e.data or {}).get("name") == "checkpoint_file" for e in _events(rec, ledger, {EventKind.MARK})
    ):
        assert time.monotonic() < deadline, "the async save's commit was never recorded"
        time.sleep(0.05)
    loaded = {"w": torch.zeros(3)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp-0"), no_dist=True)
    assert torch.equal(loaded["w"], state["w"])
    events = _events(rec, ledger, {EventKind.PHASE_END, EventKind.CHECKPOINT_COMMIT})
    named = [(e.kind, e.phase, Path((e.data or {}).get("path", "")).name) for e in events]
    assert (EventKind.PHASE_END, Phase.CHECKPOINT_BLOCKING, "dcp-0") in named
    assert (EventKind.CHECKPOINT_COMMIT, None, "dcp-0") in named
    assert (EventKind.PHASE_END, Phase.CHECKPOINT_BLOCKING, "dcp-1") in named
    assert (EventKind.PHASE_END, Phase.CHECKPOINT_PERSIST, "dcp-1") in named
    # Saved at the same step as dcp-0: one checkpoint, of which dcp-1 is a further file once it is durable.
    marks = [
        e for e in _events(rec, ledger, {EventKind.MARK}) if (e.data or {}).get("name") == "checkpoint_file"
    ]
    assert [(m.data["step"], Path(m.data["path"]).name) for m in marks] == [(0, "dcp-1")]
    assert (EventKind.PHASE_END, Phase.RESTORE, "dcp-0") in named  # before the first step: a restore
    # DCP writes through torch.save internally: those nested calls are not checkpoints of their own.
    assert sum(1 for k, p, _ in named if p is Phase.CHECKPOINT_BLOCKING) == 2
    # The async save's staging span says its persist goes on in the background, and its persist span (the
    # same step and path) says when it ended: a hang in between names the save (`Progress`, the pulse).
    blocking = {Path(e.data["path"]).name: e for e in events if e.phase is Phase.CHECKPOINT_BLOCKING}
    assert blocking["dcp-1"].data.get("persist") == "async" and "persist" not in blocking["dcp-0"].data
    (persist,) = [e for e in events if e.phase is Phase.CHECKPOINT_PERSIST]
    assert (persist.step, persist.data["path"]) == (blocking["dcp-1"].step, blocking["dcp-1"].data["path"])


def test_calls_from_ettr_modules_are_left_to_them(hooked: tuple[Any, Recorder, Any], tmp_path: Path) -> None:
    hooks, rec, ledger = hooked
    import torch.distributed.checkpoint as dcp

    hooks.on_dcp(dcp)
    # Code of an ettr module (the checkpoint manager records its own saves, spans and commits).
    namespace: dict[str, Any] = {"__name__": "ettr.checkpoint.fake_writer", "torch": torch, "dcp": dcp}
    exec(
        textwrap.dedent(
            """
            def write(state, root):
                torch.save(state, root / "plain.pt")
                dcp.save(state, checkpoint_id=str(root / "sync"), no_dist=True)
                response = dcp.async_save(state, checkpoint_id=str(root / "async"), no_dist=True)
                getattr(response, "upload_completion", response).result(timeout=60)
            """
        ),
        namespace,
    )
    namespace["write"]({"w": torch.ones(2)}, tmp_path)
    recorded = _events(rec, ledger, {EventKind.PHASE_END, EventKind.CHECKPOINT_COMMIT})
    assert [(e.kind, e.step) for e in recorded] == [(EventKind.CHECKPOINT_COMMIT, 5)]  # only the fixture's
    assert hooks.checkpoints._async_paths == set()


def test_a_long_wait_for_dataloader_workers_is_a_data_wait_span(
    hooked: tuple[Any, Recorder, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A healthy DDP job whose DataLoader workers took 15 s to start at each epoch had those waits in its
    steps: 77 s of effective training for 0.7 s of steps. A wait of at least `DATA_WAIT_SPAN_MIN_S` is a
    DATA_WAIT span (the threshold is set here so that every wait, or none, is long: no timing)."""
    import torch.utils.data.dataloader as dataloader

    import ettr.bootstrap.hooks as hooks_module
    from ettr.bootstrap.long_calls import innermost_code

    hooks, rec, ledger = hooked
    with_workers = torch.utils.data.DataLoader(list(range(4)), batch_size=2, num_workers=1)
    in_process = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    monkeypatch.setattr(hooks_module, "DATA_WAIT_SPAN_MIN_S", float("inf"))
    list(with_workers)  # the first batch's own span; no wait long enough
    monkeypatch.setattr(hooks_module, "DATA_WAIT_SPAN_MIN_S", 0.0)
    list(in_process)  # no workers: no wait for them
    assert [e.phase for e in _events(rec, ledger, {EventKind.PHASE_END})] == [Phase.GET_FIRST_BATCH_DATA]
    list(with_workers)  # every wait counts now: two batches
    with rec.phase(Phase.DATA_WAIT):  # the script's own
        list(with_workers)
    ends = [e.phase for e in _events(rec, ledger, {EventKind.PHASE_END})]
    assert ends == [Phase.GET_FIRST_BATCH_DATA, Phase.DATA_WAIT, Phase.DATA_WAIT, Phase.DATA_WAIT]
    # the heartbeat's wait site is torch's own code, under the hook
    code = innermost_code(dataloader._MultiProcessingDataLoaderIter._get_data)
    assert code is not None and code.co_filename == dataloader.__file__


def test_a_long_wait_for_a_child_process_between_steps_is_an_other_span(
    hooked: tuple[Any, Recorder, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that ran a 20 s upload (`subprocess.run`) after each save had it booked as effective training
    (25.0 s for ~4.5 s of steps; hang field trial). A wait of at least `DATA_WAIT_SPAN_MIN_S` of the main
    thread, between steps and outside any phase, is an OTHER span (the threshold set so that every wait is
    long: no timing); before the first step (a launcher waiting for its job) it is not."""
    import subprocess
    import sys

    import ettr.bootstrap.hooks as hooks_module

    hooks, rec, ledger = hooked
    monkeypatch.setattr(hooks_module, "DATA_WAIT_SPAN_MIN_S", 0.0)
    quick = [sys.executable, "-c", "pass"]
    subprocess.run(quick, check=True)  # no step yet: a launcher's wait is not this process's time
    hooks.steps.num_steps = 1
    subprocess.run(quick, check=True)
    subprocess.run(quick, check=True, capture_output=True)  # communicate(), then wait(): one span
    with rec.phase(Phase.CHECKPOINT_BLOCKING):  # a phase open books the wait already
        subprocess.run(quick, check=True)
    ends = [e.phase for e in _events(rec, ledger, {EventKind.PHASE_END})]
    assert ends == [Phase.OTHER, Phase.OTHER, Phase.CHECKPOINT_BLOCKING]


def test_explicit_phases_are_not_recorded_twice(hooked: tuple[Any, Recorder, Any], tmp_path: Path) -> None:
    """A script that records its own phases around the calls the hooks watch gets each phase once."""
    hooks, rec, ledger = hooked
    dist = torch.distributed
    with rec.phase(Phase.PROCESS_GROUP_INIT):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    with rec.phase(Phase.GET_FIRST_BATCH_DATA):
        next(iter(loader))
    with rec.phase(Phase.CHECKPOINT_BLOCKING, step=3):
        torch.save({"w": torch.ones(2)}, tmp_path / "own.pt")
    ends = [e.phase for e in _events(rec, ledger, {EventKind.PHASE_END})]
    assert ends.count(Phase.PROCESS_GROUP_INIT) == 1
    assert ends.count(Phase.GET_FIRST_BATCH_DATA) == 1
    assert ends.count(Phase.CHECKPOINT_BLOCKING) == 1
    commits = [e for e in _events(rec, ledger, {EventKind.CHECKPOINT_COMMIT}) if e.attempt == rec.attempt]
    assert commits == []  # the script commits its own saves


def _one_step_at_a_time() -> Any:
    """A hooked optimizer's training step, one call each (a tiny model)."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train() -> None:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    return train


def test_optimizer_steps_after_a_resume_recorded_by_unhooked_code_count_on_from_it(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    # ettr.checkpoint's manager (ettr's own code, not hooked) restores step 40 and records RESUMED(40); the
    # script numbers its steps itself after each optimizer step. Its first step was recorded as step 1 by the
    # optimizer hook (the script's own 41 came after it): one step too many, and a resume from scratch
    # for books that go by the first step.
    hooks, rec, ledger = hooked
    train = _one_step_at_a_time()
    rec.resumed_from(40)
    for step in (41, 42):
        train()
        rec.step(step)
    steps = [e.step for e in _events(rec, ledger, {EventKind.STEP})]
    assert steps == [41, 41, 42]  # the hook's guess and the script's own agree; then only the script's


def test_a_resume_recorded_after_steps_were_counted_does_not_renumber_them(
    hooked: tuple[Any, Recorder, Any],
) -> None:
    hooks, rec, ledger = hooked
    train = _one_step_at_a_time()
    for _ in range(2):
        train()
    rec.resumed_from(40)  # late: the steps already taken are not this resume's
    train()
    steps = [e.step for e in _events(rec, ledger, {EventKind.STEP})]
    assert steps == [1, 2, 3]

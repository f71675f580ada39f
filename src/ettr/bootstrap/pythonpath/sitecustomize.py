"""ettr's bootstrap, loaded by every Python process `ettr run` starts (this directory is on PYTHONPATH).

It instruments the process if it is a training process of the run (`ettr.bootstrap.start`), then runs the
`sitecustomize` this one shadows, if any. Costs one environment lookup in processes it leaves alone, and
never raises: a Python without ettr, or any error, leaves the script exactly as it was.
"""


def _ettr_bootstrap() -> None:
    import os

    env = os.environ
    if not env.get("ETTR_RUN_DIR"):
        return
    import sys

    argv = getattr(sys, "orig_argv", None) or []
    if any(
        "torchrun" in a
        or "torch.distributed." in a
        or "accelerate" in a
        or "deepspeed" in a
        or a.endswith("/ds")
        for a in argv[1:6]
    ):
        # Perhaps a torchrun launcher (or `accelerate launch`, DeepSpeed's) that the job started itself (a shell script,
        # a Makefile, a Python program): never a rank; `ettr.bootstrap.start` makes its workers the ranks.
        try:
            from ettr.bootstrap.start import start
        except Exception:
            return
        start()
        return
    # Cheap pre-checks mirroring `ettr.run_env.RunEnv.is_training_process`, so that the children of a
    # training process (data loader, compile workers) do not even import ettr. The names are spelled out
    # (RUN_DIR_ENV, INSTRUMENTED_ENV, LAUNCHER_ENV, TORCHELASTIC_RUN_ID_ENV of `ettr.run_env`; a test keeps
    # them equal) because importing ettr here is what this check avoids.
    marker = env.get("ETTR_INSTRUMENTED_PID")
    if marker and marker != str(os.getpid()):
        if any("--multiprocessing-fork" in a or "multiprocessing.forkserver" in a for a in argv[1:6]):
            # Started by multiprocessing (spawn, forkserver): a rank if it joins a process group (PyTorch's
            # tutorial starts its ranks so); `ettr.bootstrap.spawned.watch_join` (MULTIPROCESSING_CHILD_ARGS).
            try:
                from ettr.bootstrap.spawned import watch_join
            except Exception:
                return
            watch_join()
        elif env.get("ETTR_INSTRUMENTED_WORLD") == "1" and any(
            env.get(name, "1") not in ("", "0", "1")
            for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        ):
            # Started as a rank of a larger world by a program that is alone: a launcher of the user's own
            # (`ettr.bootstrap.spawned.launched_rank`; the names are its LAUNCHED_WORLD_NAMES).
            try:
                from ettr.bootstrap.spawned import launched_rank
            except Exception:
                return
            launched_rank()
        return
    if env.get("ETTR_LAUNCHER") == "torchrun" and not env.get("TORCHELASTIC_RUN_ID"):
        return
    try:
        from ettr.bootstrap.start import start
    except Exception:
        return  # another interpreter, without ettr: nothing to do
    start()


def _ettr_chain() -> None:
    """Execute the next `sitecustomize` on sys.path, the one this file hides."""
    import importlib._bootstrap  # not importlib.util: its imports alone cost milliseconds per process
    import importlib.machinery
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib._bootstrap.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _ettr_bootstrap()
except Exception:
    pass
try:
    _ettr_chain()
except Exception:
    import traceback

    traceback.print_exc()  # the chained sitecustomize's own error, shown as Python itself would

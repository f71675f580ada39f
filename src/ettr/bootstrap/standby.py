"""A warm standby: a Python process that has done its start-up (interpreter, `import torch`, ettr) ahead of
the next attempt, and becomes that attempt's `python SCRIPT ARGS...` once told to.

    python [-u] -m ettr.bootstrap.standby FD [MODULE,MODULE...] [STATUS_FD]
        (started by `ettr.supervisor.standby`; the modules are imported ahead too)

It says how far it is on STATUS_FD: `w` once its warm-up is done (it waits for the attempt then), `h` once
it has the attempt's request (it starts running it), so that the supervisor knows, at a failure, whether
the standby is ready or still warming, and can say what the next attempt waits for. The supervisor sets its
priority: SCHED_IDLE while it warms up behind a training attempt, every thread back to normal when it is
handed an attempt (`ettr.supervisor.standby`). It reads one JSON
object from the pipe FD (stdin stays the job's): {"argv": [python, [-u,] script | -m module, args...],
"env": {...}, "cwd": "..."}, the attempt's complete command line, environment and directory. It then replaces its whole environment by
that one, runs ettr's bootstrap for the attempt (recorder, heartbeat, injector, torch hooks) and the script
(or module) as `__main__` in a fresh `__main__` module, with the same absolute `__file__`, `sys.argv`, working
directory and `sys.path[0]` as `python SCRIPT` (`python -m MODULE`) would have (`_as_main`). EOF
on the pipe without a request (the supervisor discarded it) exits 0 at once. The supervisor only hands over an
attempt whose environment, apart from the per-attempt `ETTR_*` names, equals the one this process was
started with (what `import torch` may have read), so it never runs with stale state.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import types
from collections.abc import Callable

SPAWNED_AT = time.time()


BOOTSTRAP_MODULES = (
    "ettr.bootstrap.hooks",
    "ettr.bootstrap.start",
    "ettr.runtime",
    "ettr.compile.autoinstall",
)
"""What the hand-over imports (`main`) before the attempt's script runs: imported by the warm-up."""


def _warm_up(modules: list[str], *, stop: Callable[[], bool] | None = None) -> None:
    """The start-up done ahead: `import torch`, `modules` (given by the supervisor: torch's parts and the
    installed packages the last attempt had imported by its first step) and the modules ettr's bootstrap
    will need, and inductor's CPU vector-ISA probe when the attempt ran it (`VEC_ISA_PROBE`). Imports only
    (and that probe; inductor's kernel templates left to their first use, `_defer_kernel_templates`): no
    tensor is made, no random state drawn. The working directory is off the
    path meanwhile, so a module there never stands in for an installed package of the same name. `stop`,
    asked after each import: True ends the warm-up there (a zygote that can no longer fork).

    The cyclic garbage collector is off meanwhile, then runs once (a full collection, which frees what the
    imports left as cyclic garbage and counts what lives on as old, as the collections during the imports
    would have), then goes back on as it was before anything else runs: the imports allocate hundreds of
    thousands of objects that all live on, and the collections they set off (8 full ones for torch, TorchRec
    and inductor's compile path) free next to nothing. Measured here, six interleaved pairs at load 8.6-9.9:
    2.97 s of CPU with it on, 2.63 s with it off and one collection after (medians; -12%), and the
    allocations that follow (the attempt's start) no slower (0.40 -> 0.34 s for 200,000 lists). Nothing is
    frozen (`gc.freeze` would hide the modules' objects from `gc.get_objects` and `gc.get_referrers` in
    every forked child, which a cold start does not)."""
    import importlib

    first = sys.path.pop(0) if sys.path else None  # `-m` put the working directory first
    collecting = gc.isenabled()
    gc.disable()
    try:
        # A zygote asks first what `import torch` imports first of its own and what starts the one thread seen
        # (numpy's OpenBLAS pool without OMP_NUM_THREADS=1): 0.1 s of imports instead of torch's 0.9 s before
        # it knows it cannot fork. The order changes nothing else: torch imports numpy anyway.
        first_of_torch = ["numpy"] if stop is not None else []
        for name in [*first_of_torch, "torch", *modules, *BOOTSTRAP_MODULES]:
            if name == COMPILE_PATH and "torch" in sys.modules:
                _defer_kernel_templates()
            try:
                importlib.import_module(name)
            except Exception as exc:  # the attempt then pays for it, as a cold start would
                # Said for torch and ettr only: a learned package that will not import here (a namespace
                # package a .pth file set up, say) is the attempt's business, not a line in the job's log.
                if name == "torch" or name.startswith("ettr."):
                    print(
                        f"ettr: standby warm-up skipped {name} ({type(exc).__name__}: {exc})", file=sys.stderr
                    )
            if stop is not None and stop():
                return
        if VEC_ISA_PROBE in modules:  # the attempt compiled CPU kernels: its first compile probed the ISA
            _probe_vec_isa()
    finally:
        gc.collect()
        if collecting:
            gc.enable()
        if first is not None:
            sys.path.insert(0, first)


VEC_ISA_PROBE = "torch._inductor.cpu_vec_isa"
"""`ettr.bootstrap.start.VEC_ISA_PROBE` (spelled out: this module imports nothing of ettr before the warm-up)."""
COMPILE_PATH = "torch._inductor.compile_fx"
"""Inductor's compile path, one of `ettr.bootstrap.start.TORCH_PARTS` (spelled out, as `VEC_ISA_PROBE`)."""


def _defer_kernel_templates() -> None:
    """Before the warm-up imports inductor's compile path: its GPU kernel templates compile at their first
    use, as the attempt's own compile session makes them (`ettr.compile.lazy_templates`; it finds them so and
    leaves them), instead of at the import (measured here: importing the compile path after torch and Dynamo
    took 0.87 s of CPU, 0.76 s with them deferred; the demo's requeue warm-up, 174 modules, 4.01 -> 3.77 s,
    medians of five interleaved at load 10-13). Only where torch has no GPU backend built in: a GPU job
    renders them (the session leaves them to inductor there), and asking whether a GPU is present would
    initialise CUDA's driver in a process that forks the attempt's workers (the zygote)."""
    try:
        import torch

        if torch.backends.cuda.is_built() or getattr(torch.version, "hip", None):
            return
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and getattr(xpu, "_is_compiled", lambda: True)():
            return
        from ettr.compile import lazy_templates
        from ettr.patcher import Patcher

        lazy_templates.defer(Patcher())
    except Exception:  # the import then compiles them, as a cold start's would
        pass


def _probe_vec_isa() -> None:
    """Inductor's CPU vector-ISA probe, as the attempt's first compile ran it (it builds a small library per
    ISA into inductor's cache directory and loads each in a Python subprocess, ~1.2 s of CPU here): the
    answer is cached for the process, so a replacement's first compile does not wait for it. No tensor, no
    random state; the answer depends only on the CPU and the compiler, which the attempt shares. Shared and
    remembered as the attempt's compile session does it (`ettr.compile.isa_probe`): the answer the attempt's
    probe left in inductor's cache directory (as this process's environment names it: where the attempt's
    first compile probed unless its script moved it) is taken instead of probing again, and a probe run here
    leaves its answer there. Measured here, three interleaved pairs at load 5-6: the warm-up's probe took
    1.11-1.20 s of its subprocesses' CPU (1.9-2.9 s of wall) before, none (0.01 s) with the answer
    remembered."""
    try:
        from ettr.compile import isa_probe
        from ettr.patcher import Patcher
        from ettr.torch_compat import probe_vec_isa

        isa_probe.share(Patcher())
        probe_vec_isa()
    except Exception as exc:  # the attempt then probes, as a cold start would
        print(f"ettr: standby warm-up skipped the ISA probe ({type(exc).__name__}: {exc})", file=sys.stderr)


def _read_request(fd: int) -> dict | None:
    with os.fdopen(fd, "rb") as pipe:
        raw = pipe.read()
    if not raw.strip():
        return None
    return json.loads(raw)


def _say(status_fd: int | None, what: bytes) -> None:
    if status_fd is not None:
        with contextlib.suppress(OSError):  # the supervisor stopped listening: nothing to tell
            os.write(status_fd, what)


def main() -> None:
    fd = int(sys.argv[1])
    status_fd = int(sys.argv[3]) if len(sys.argv) > 3 else None
    _warm_up([name for name in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if name])
    warm_at = time.time()
    _say(status_fd, b"w")
    request = _read_request(fd)
    from ettr.procs import normal_scheduling

    normal_scheduling(os.getpid())  # the supervisor did (`Standby.take`); the attempt runs as a cold start
    if request is None:
        return
    handed_at = time.time()
    _say(status_fd, b"h")
    if status_fd is not None:
        with contextlib.suppress(OSError):
            os.close(status_fd)  # the attempt's script never sees it
    run_request(request, handed_at, "standby", spawned_at=SPAWNED_AT, warm_at=warm_at, handed_at=handed_at)


def run_request(request: dict, started_at: float, mark: str, **fields: float) -> None:
    """Become the attempt `request` asks for ({"argv", "env", "cwd"}): its whole environment and working
    directory, ettr's bootstrap (the attempt's process starts at `started_at`; the recorder's `mark` MARK
    with `fields` and the pid says where it came from), then its script or module as `__main__`. Shared with
    the zygote's forked children (`ettr.bootstrap.zygote`)."""
    argv, env, cwd = list(request["argv"]), dict(request["env"]), str(request["cwd"])
    tee = os.environ.get(
        "ETTR_STDERR_TEE"
    )  # ettr.warn.STDERR_TEE_ENV: this process's stderr stays the same pipe
    os.environ.clear()
    os.environ.update(env)
    if tee and "ETTR_STDERR_TEE" not in env:  # a zygote's child is told its own pipe in `env`
        os.environ["ETTR_STDERR_TEE"] = tee
    os.chdir(cwd)
    at = 1
    while argv[at] == "-u":  # the standby was started with the same options (`ettr.supervisor.standby`)
        at += 1
    module = argv[at + 1] if argv[at] == "-m" else None
    run_attempt = _as_main(module, argv[at + 1 :] if module else argv[at:])
    try:
        import ettr.runtime
        from ettr.bootstrap.start import start
        from ettr.compile.autoinstall import after_warm_up

        after_warm_up()  # the workload's inductor cache directory, as a cold start picks it

        # The attempt's process starts now, at the hand-over, not when this process was spawned.
        ettr.runtime.process_start_time = lambda: started_at
        start()
        from ettr.bootstrap.spare import is_held, note_origin

        if is_held():  # a spare: nothing recorded until it is promoted, which says this too
            note_origin(mark, fields)
        else:
            ettr.runtime.get_recorder().mark(mark, **fields, pid=os.getpid())
        if mark == "zygote" and not is_held():
            # A forked worker trains within a fraction of a second (a cold start imports for seconds while its
            # recorder writes): its start is in the books before a stop signal can end it unwritten.
            ettr.runtime.get_recorder().flush(1.0)
    except Exception as exc:
        print(f"ettr: {mark} bootstrap failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    run_attempt()


def _fresh_main_module() -> types.ModuleType:
    """A new `__main__` in `sys.modules`, as the interpreter makes it before it runs a script: the
    standby's own module (this one) is not the script's namespace."""
    import builtins
    import importlib.machinery

    main = types.ModuleType("__main__")
    main.__dict__.update(
        __builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter, __annotations__={}
    )
    sys.modules["__main__"] = main
    return main


def _module_origin(name: str) -> str | None:
    """The file `python -m NAME` would run, found on `sys.path` without importing anything (a package's
    `__init__` runs only once the attempt runs it, after ettr's bootstrap, as at a cold start); None when
    it cannot be told that way (a namespace or import-hooked package: runpy then sets `sys.argv[0]`)."""
    import importlib.machinery

    path: list[str] | None = sys.path
    spec = None
    for part in name.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    if spec is not None and spec.submodule_search_locations:  # a package: its __main__
        spec = importlib.machinery.PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
    return spec.origin if spec is not None and spec.has_location else None


def _as_main(module: str | None, args: list[str]) -> Callable[[], None]:
    """Set `sys.argv`, `sys.path[0]` and `__main__` as `python SCRIPT ARGS` (`args[0]` is the script) or
    `python -m MODULE ARGS` (`module`; `args[0]` is its name) would have them; returns what runs it.

    A script's `__file__` (and its code's file name, its loader's path) is the script joined to the working
    directory, `sys.argv[0]` the script as given, `sys.path[0]` the directory of the script with links
    resolved. A module's `sys.argv[0]` is its file, `sys.path[0]` the working directory; it runs as
    `python -m` runs it (`runpy._run_module_as_main`). Checked against a cold start in tests/test_standby.py."""
    if module is not None:
        import runpy

        sys.argv = list(args)
        sys.path[0] = os.getcwd()
        sys.argv[0] = _module_origin(module) or sys.argv[0]  # ettr's compile key reads it before runpy would
        _fresh_main_module()
        return lambda: runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]
    import importlib.machinery
    import io

    script = args[0]
    path = os.path.join(os.getcwd(), script)  # not normalized, as CPython makes the script's path absolute
    sys.argv = list(args)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    main = _fresh_main_module()
    main.__dict__.update(
        __file__=path, __cached__=None, __loader__=importlib.machinery.SourceFileLoader("__main__", path)
    )

    def run() -> None:
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        try:
            exec(code, main.__dict__)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            # The script's traceback as a cold start prints it: from the script's own frame on.
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code is not code:
                tb = tb.tb_next
            if tb is not None:
                exc.with_traceback(tb)  # the default hook prints the exception's own traceback
            sys.excepthook(type(exc), exc, exc.__traceback__)
            sys.exit(1)

    return run


if __name__ == "__main__":
    main()

"""Calls that may legitimately keep the training thread in one place for long: the pulse names their phase.

The hang bound once steps run is ten step times (at least 10 s). A training thread that waits that long in a
DataLoader for its worker processes, in a synchronous `torch.save` to slow storage, or in a load, is not hung:
its pulse says the phase it is in, and the phase's bound applies (docs/supervisor.md, "Hangs"). The hooks
record these spans only once the call has returned (their begin is known then too), so the books cannot say
it while it lasts; the heartbeat's sampler sees the call on the training thread's stack instead
(`Progress.add_wait_site`), with nothing hooked or recorded. Measured: a healthy job with 50 ms steps whose
100 MB `torch.save` to slow storage took longer than 10 s was killed as hung; so was a DDP job whose
DataLoader workers took 15 s to start at each epoch, and one that ran a 20 s upload command with
`subprocess.run` after a save.

Each site is the library's own function, under any wrappers (ettr's hooks wrap some of them with
`functools.wraps`, which leaves `__wrapped__`): its code is on the stack for as long as the call runs.
Registered once each module is imported (`ettr.post_import`), never importing one itself.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType, ModuleType
from typing import Any

from ettr.events import Phase
from ettr.heartbeat import Progress

LONG_CALLS: tuple[tuple[str, tuple[str, ...], Phase], ...] = (
    ("torch.serialization", ("save",), Phase.CHECKPOINT_BLOCKING),
    ("torch.serialization", ("load",), Phase.RESTORE),
    ("safetensors.torch", ("save_file",), Phase.CHECKPOINT_BLOCKING),
    ("safetensors.torch", ("load_file",), Phase.RESTORE),
    ("torch.distributed.checkpoint", ("save", "async_save", "save_state_dict"), Phase.CHECKPOINT_BLOCKING),
    ("torch.distributed.checkpoint", ("load", "load_state_dict"), Phase.RESTORE),
    ("subprocess", ("Popen.wait", "Popen.communicate"), Phase.OTHER),
    ("torch._dynamo.convert_frame", ("_compile",), Phase.COMPILE),
    ("torch.distributed.distributed_c10d", ("destroy_process_group",), Phase.SHUTDOWN),
    ("torch.distributed.rpc.api", ("shutdown",), Phase.SHUTDOWN),
)
"""(module, its functions (a dotted name: a class's), the phase the training thread is in while it runs one).
A child process the script waits for (`subprocess.run([... "s3", "cp", ...])` after a save) is not
instrumented (a child of a rank is left alone), so the rank's wait for it is `other`, not a silence.
Dynamo's `_compile` (one frame's compilation, inductor's included: minutes on a busy node) is recorded as a
`compile` span only once it returned; while it runs, its pulse says `compile` (the compile bound applies, and
the console's start-up lines name it: nanoGPT's first compile took 379 s at load 40 and the console said
`cold start: interpreter, imports, model build, restore` throughout). Its frame sits up to ~120 frames below
the top of the stack (`heartbeat._WAIT_SITE_DEPTH`).
A job's teardown waits for its peers: `destroy_process_group`, and `rpc.shutdown`, whose graceful form waits for
every worker of the RPC group; a parameter-server job's trainers (pytorch/examples' `distributed/rpc/ddp_rpc`)
sit in it on the main thread while the master drives their loops through RPC, and after their last step it took
over 10 s at load 18: the job, its 4,000 steps done, was killed as hung in all three attempts and failed (exit
3). While it runs, its pulse says `shutdown` (the phase bound, 300 s by default, applies: such a job's hang is
caught by that bound, not by the step bound)."""

_UNWRAP_DEPTH = 8


def innermost_code(function: object) -> CodeType | None:
    """The code of `function` under its `functools.wraps` wrappers (None: not a Python function)."""
    for _ in range(_UNWRAP_DEPTH):
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            break
        function = inner
    code = getattr(function, "__code__", None)
    return code if isinstance(code, CodeType) else None


def watch_long_calls(
    progress: Progress, when_imported: Callable[[str, Callable[[ModuleType], None]], None]
) -> None:
    """Register `LONG_CALLS` and the DataLoader's wait for its workers with `progress` as each module is
    imported (`when_imported`: `ettr.post_import.when_imported`)."""
    by_module: dict[str, list[tuple[tuple[str, ...], Phase]]] = {}
    for module, names, phase in LONG_CALLS:
        by_module.setdefault(module, []).append((names, phase))

    def register(entries: list[tuple[tuple[str, ...], Phase]]) -> Callable[[ModuleType], None]:
        def on_import(module: ModuleType) -> None:
            for names, phase in entries:
                for name in names:
                    target: object = module
                    for part in name.split("."):
                        target = getattr(target, part, None)
                    code = innermost_code(target)
                    if code is not None:
                        progress.add_wait_site(code, phase.value)

        return on_import

    for module, entries in by_module.items():
        when_imported(module, register(entries))

    def on_dataloader(module: Any) -> None:
        from ettr.torch_compat import dataloader_worker_iter

        code = innermost_code(getattr(dataloader_worker_iter(), "_get_data", None))
        if code is not None:
            progress.add_wait_site(code, Phase.DATA_WAIT.value)

    when_imported("torch.utils.data.dataloader", on_dataloader)

"""The script's own `destroy_process_group`: the groups it destroys are held until the interpreter's exit
handlers run, and let go there, where their destructors run with the GIL free.

torch's gloo process group joins its worker threads in its destructor. A DDP model's reducer holds a
reference to its process group, so a script that destroys the group and then drops the model
(pytorch/examples' `ddp-tutorial-series/multigpu_torchrun.py`: `destroy_process_group()` at the end of
`main()`, the DDP model a local of it) has the reducer's destructor release the group last, in the main
thread with the GIL held, and join a gloo worker there. A worker still ending the last all-reduce's work needs
the GIL to drop the Python context every backward pass leaves in the work's thread-local state
(`torch.autograd.graph._engine_run_backward` stashes `contextvars.copy_context()`), and the join never returns
(pytorch#56297's kind). Seen in a field trial (2026-12-04) in 6 of 18 attempts run in warm standbys, none of
26 cold: the watchdog booked the completed job's last attempt `hung` and ran it again.

Held here, the reducer's release is not the last. The exit handler lets the groups go through their Python
wrappers, whose destructor releases the GIL while it joins (torch's `intrusive_ptr_no_gil_destructor`), while
the interpreter still runs every thread. A script that keeps its DDP model to the interpreter's end (a module
global) releases it there as before.

ettr's own calls are not held: the in-place recovery's teardown (`ettr.inplace.rendezvous`) destroys the groups
so that their connections close at once and a blocked peer fails (docs/inplace.md); it lets go of the held ones
too before it collects (a `train` that destroys its group in a `finally:`)."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ettr.bootstrap.hooks import Guard, called_from_ettr
from ettr.patcher import Patcher

_held: list[Any] = []
"""The process groups the script destroyed, until the exit handler lets them go."""
_registered = False


def _groups(c10d: ModuleType, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The groups a `destroy_process_group(*args, **kwargs)` call destroys: the one named, or all of them."""
    group = args[0] if args else kwargs.get("group")
    world = c10d._world  # noqa: SLF001 - the map destroy_process_group itself reads
    if group is None or group is c10d.GroupMember.WORLD:
        return list(world.pg_map)
    return [group] if group in world.pg_map else []


def release() -> None:
    """Let the held groups go (the exit handler; their destructors join their workers without the GIL)."""
    _held.clear()


def _hold(groups: list[Any]) -> None:
    global _registered
    _held.extend(groups)
    if not _registered:
        _registered = True
        atexit.register(release)


def install(torch: ModuleType, patcher: Patcher, guard: Guard) -> None:
    """Wrap `torch.distributed.destroy_process_group` (see the module docstring)."""
    dist = torch.distributed
    if not dist.is_available():
        return
    c10d = dist.distributed_c10d

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            if called_from_ettr():
                return original(*args, **kwargs)
            groups = guard.call("destroy_process_group", _groups, c10d, args, kwargs) or []
            result = original(*args, **kwargs)
            guard.call("destroy_process_group", _hold, groups)
            return result

        return destroy_process_group

    before = getattr(dist, "destroy_process_group", None)
    unwrapped = c10d.destroy_process_group
    patcher.wrap(c10d, "destroy_process_group", make)
    if before is unwrapped:
        patcher.set(dist, "destroy_process_group", c10d.destroy_process_group)

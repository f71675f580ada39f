"""Inductor's CPU vector-ISA probe, run ahead on the compile session's restore thread, one answer shared.

A process's first CPU kernel compile probes the CPU's vector ISAs (`cpu_vec_isa.valid_vec_isa_list`): it
builds a small library per ISA into inductor's cache directory (a restored store entry brings them) and
loads each in a Python subprocess (libtorch loaded six times, ~1.2 s of CPU here), and the compiling thread
waits for it. Started on a helper thread once the store entry is restored, the probe's subprocesses run
while the compiling thread imports inductor's compile path and Dynamo traces. The probe is wrapped in a lock
first (`share`): a compile that needs the answer while the helper still probes waits for that probe, rather
than starting a second one beside it (inductor caches the answer with `functools.cache`, which holds no lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ettr import torch_compat
from ettr.patcher import ORIGINAL_ATTR, Patcher

logger = logging.getLogger("ettr")


def share(patcher: Patcher) -> bool:
    """Wrap inductor's probe so that concurrent callers share one run; whether it is wrapped now (False:
    inductor moved it). The wrapper keeps the cache's `cache_info` and `cache_clear`, which
    `torch_compat.inductor_probed_vec_isa` reads. Imports inductor's codecache (the probe's)."""
    try:
        module = torch_compat.inductor_vec_isa_module()
    except ImportError as exc:
        logger.debug("ettr: inductor's ISA probe not shared (%s)", exc)
        return False
    patcher.wrap(module, "valid_vec_isa_list", _locked)  # (not twice: a wrapper of ours is left alone)
    return getattr(getattr(module, "valid_vec_isa_list", None), ORIGINAL_ATTR, None) is not None


def run() -> None:
    """Run the (shared) probe now; never raises (the first compile then probes, as it would have)."""
    try:
        torch_compat.probe_vec_isa()
    except Exception as exc:
        logger.debug("ettr: inductor's ISA probe not run ahead (%s)", exc)


def _locked(probe: Callable[[], Any]) -> Callable[[], Any]:
    lock = threading.RLock()  # re-entrant: the probe of one thread never waits for itself

    def shared_probe() -> Any:
        with lock:
            return probe()

    for name in ("cache_info", "cache_clear"):  # methods of the cache, which `update_wrapper` does not copy
        if hasattr(probe, name):
            setattr(shared_probe, name, getattr(probe, name))
    return shared_probe

"""What libraries keep of a generation at module level, forgotten when it is torn down.

A library that caches a process group, or that does a start-up collective only once per process, breaks a
restart in place: the surviving rank keeps the failed generation's state while its replacement starts
fresh, so the two disagree on which collectives the next generation's start-up makes, and both wait until
the collective timeout. TorchRec does both (torchrec 1.x):

- `torchrec.distributed.collective_utils`: `DistributedModelParallel.__init__` broadcasts the collective
  validation flag from rank 0 once per process (`_INITIALIZED`). The survivor skipped the broadcast its
  replacement made, and the demo's DLRM hung in its second generation (gloo: "Timed out waiting 300000ms
  for send operation").
- `torchrec.distributed.comm`: the intra- and cross-node groups (`_INTRA_PG`, `_CROSS_PG`, and their 2-D
  versions), made with `new_group` (collectively) on first use and cached.

`forget` puts them back to what they were at import, so every rank's next generation starts as a fresh
process does. Only modules already imported are touched (nothing is imported here).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("ettr")

RESET_AT_TEARDOWN: dict[str, dict[str, object]] = {
    "torchrec.distributed.collective_utils": {"_INITIALIZED": False, "_USE_COLLECTIVE_VALIDATION": False},
    "torchrec.distributed.comm": {
        "_INTRA_PG": None,
        "_CROSS_PG": None,
        "_INTRA_PG_2D": None,
        "_CROSS_PG_2D": None,
        "_NODE_GROUP_SIZE_2D": None,
    },
}
"""Module -> its per-process state and the value it has at import."""


def forget() -> list[str]:
    """Reset `RESET_AT_TEARDOWN` in the modules imported so far; returns the `module.name`s reset (those
    that had changed). Never raises."""
    reset = []
    for module_name, names in RESET_AT_TEARDOWN.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name, initial in names.items():
            if not hasattr(module, name):  # another version of the library
                continue
            try:
                if getattr(module, name) is not initial:
                    setattr(module, name, initial)
                    reset.append(f"{module_name}.{name}")
            except Exception as exc:
                logger.debug("ettr: resetting %s.%s: %s", module_name, name, exc)
    return reset

"""Is Dynamo tracing the calling frame? The one check ettr's hooks use before doing bookkeeping.

Recording (or timing a collective) while Dynamo traces would put a graph break in the user's model, so
the recorder and the init audit step aside then. Only while Dynamo traces: `torch.compiler.is_compiling()`
is true process-wide for a whole compilation in torch 2.13, which would also silence every other thread
(the first-batch wait overlapping a compile). Never imports torch: without torch nothing is being traced.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

_check: Callable[[], bool] | None = None


def dynamo_is_tracing() -> bool:
    """Whether torch Dynamo is tracing the calling frame (False when torch is not imported)."""
    global _check
    check = _check
    if check is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        compiler = torch.compiler
        check = getattr(compiler, "is_dynamo_compiling", None) or compiler.is_compiling
        _check = check
    return check()

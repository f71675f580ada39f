"""Zero-code instrumentation: what `ettr run` loads into its Python children.

`ettr run` puts `bootstrap/pythonpath/` first on the children's PYTHONPATH; its `sitecustomize.py` decides
whether this process is a training process of the run and, if so, calls `ettr.bootstrap.start.start()`,
then chains any other `sitecustomize` on the path. `start` sets up the recorder (PROCESS_START), the
training-thread heartbeat, fault injection and, unless `--no-auto`, the torch hooks of `hooks` and
`checkpoint_hooks`, installed lazily when the script imports torch (`ettr.post_import`). What the bootstrap
reads from its environment is the run contract, `ettr.run_env`; it imports nothing of `ettr.supervisor`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def pythonpath_dir() -> Path:
    """The directory `ettr run` puts first on the children's PYTHONPATH (it holds only `sitecustomize.py`).

    The bootstrap names its own location, so a launcher never guesses where the package is installed.
    """
    from pathlib import Path  # here, not at import: the bootstrap's own start-up imports as little as it can

    return Path(os.path.dirname(os.path.abspath(__file__))) / "pythonpath"

"""The bootstrap's framework integrations: every Lightning or Hugging Face `Trainer` gets ettr's callback.

Once the script imports a framework's trainer module, `Trainer.__init__` is wrapped so that the new trainer
goes through `install_on` of `ettr.integrations.lightning` / `.huggingface`: it gains an `EttrCallback`
unless the user gave it one (never two) — and the construction itself is an INIT_PLUGINS span (the
framework's accelerator, strategy and plugins). Nothing is imported before the script imports the framework.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ettr.bootstrap.hooks import Guard, Patcher
from ettr.events import Phase
from ettr.recorder import EventSink

TRAINER_MODULES: dict[str, str] = {
    "lightning.pytorch.trainer.trainer": "ettr.integrations.lightning",
    "pytorch_lightning.trainer.trainer": "ettr.integrations.lightning",
    "transformers.trainer": "ettr.integrations.huggingface",
}
"""The module that defines each framework's `Trainer` -> the integration that instruments it."""


class FrameworkHooks:
    """Wraps `Trainer.__init__` of each framework module it is given (`on_import`, a post-import callback)."""

    def __init__(self, rec: EventSink, *, guard: Guard, patcher: Patcher) -> None:
        self.rec = rec
        self.guard = guard
        self.patcher = patcher
        self._local = threading.local()

    def on_import(self, module: ModuleType) -> None:
        integration = TRAINER_MODULES.get(module.__name__)
        trainer_class = getattr(module, "Trainer", None)
        if integration is None or not isinstance(trainer_class, type):
            return
        hooks = self

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(trainer: Any, *args: Any, **kwargs: Any) -> None:
                outermost = not getattr(hooks._local, "depth", 0)  # a subclass's __init__ calls ours again
                hooks._local.depth = getattr(hooks._local, "depth", 0) + 1
                begin = time.time()
                try:
                    original(trainer, *args, **kwargs)
                finally:
                    hooks._local.depth -= 1
                if outermost:
                    hooks.guard.call(f"{integration} callback", hooks.instrument, integration, trainer, begin)

            return __init__

        self.patcher.wrap(trainer_class, "__init__", make)

    def instrument(self, integration: str, trainer: Any, begin: float) -> None:
        """Time the trainer's construction (accelerator, strategy, plugins: an init sub-stage) and give it
        the integration's callback."""
        framework = integration.rsplit(".", 1)[-1]
        self.rec.span(Phase.INIT_PLUGINS, begin, framework=framework, stage="trainer_init")
        importlib.import_module(integration).install_on(trainer, self.rec)

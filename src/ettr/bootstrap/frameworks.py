"""The bootstrap's framework integrations: every Lightning or Hugging Face `Trainer` gets ettr's callback.

Once the script imports a framework's trainer module, `Trainer.__init__` is wrapped so that the new trainer
goes through `install_on` of `ettr.integrations.lightning` / `.huggingface`: it gains an `EttrCallback`
unless the user gave it one (never two). Nothing is imported before the script imports the framework.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ettr.bootstrap.hooks import Guard, Patcher
from ettr.recorder import RecorderProtocol

TRAINER_MODULES: dict[str, str] = {
    "lightning.pytorch.trainer.trainer": "ettr.integrations.lightning",
    "pytorch_lightning.trainer.trainer": "ettr.integrations.lightning",
    "transformers.trainer": "ettr.integrations.huggingface",
}
"""The module that defines each framework's `Trainer` -> the integration that instruments it."""


class FrameworkHooks:
    """Wraps `Trainer.__init__` of each framework module it is given (`on_import`, a post-import callback)."""

    def __init__(self, rec: RecorderProtocol, *, guard: Guard, patcher: Patcher) -> None:
        self.rec = rec
        self.guard = guard
        self.patcher = patcher

    def on_import(self, module: ModuleType) -> None:
        integration = TRAINER_MODULES.get(module.__name__)
        trainer_class = getattr(module, "Trainer", None)
        if integration is None or not isinstance(trainer_class, type):
            return
        hooks = self

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(trainer: Any, *args: Any, **kwargs: Any) -> None:
                original(trainer, *args, **kwargs)
                hooks.guard.call(f"{integration} callback", hooks.instrument, integration, trainer)

            return __init__

        self.patcher.wrap(trainer_class, "__init__", make)

    def instrument(self, integration: str, trainer: Any) -> None:
        importlib.import_module(integration).install_on(trainer, self.rec)

"""Restart in place: a rank's failure re-forms the process group with its replacement while the other ranks
live on, and the state comes back from memory (docs/inplace.md). `ettr.resilient` is the entry point."""

from ettr.inplace.config import InPlaceConfig
from ettr.inplace.wrapper import Generation, InPlaceGaveUp, resilient

__all__ = ["Generation", "InPlaceConfig", "InPlaceGaveUp", "resilient"]

"""Compile time: a persistent artifact store, recompile recording and prevention, and fast-batch start-up.

    import ettr.compile
    ettr.compile.autoinstall()        # under `ettr run` the bootstrap does this; one call otherwise

records every compilation and recompile, restores compiled artifacts before the first compile, applies
the dynamic inputs learned by earlier attempts and jobs, and saves the artifacts once compiling settles.
`fast_start` compiles on a synthetic batch while the data loader and the checkpoint read warm up.
Importing this package does not import torch.
"""

from __future__ import annotations

from ettr.compile.autoinstall import autoinstall, current_session
from ettr.compile.backend import FsspecBackend, LocalBackend, MemoryBackend, StoreBackend, open_backend
from ettr.compile.config import CompileConfig
from ettr.compile.dynamic import DynamicSource
from ettr.compile.fastbatch import TensorSpec, load_spec, save_spec, spec_of, synthesize
from ettr.compile.hooks import CompileHooks, CompileRecord
from ettr.compile.key import StoreKey, current_key
from ettr.compile.session import CompileSession
from ettr.compile.startup import StartupResult, fast_start, warm_up
from ettr.compile.store import CompileStore, EntryRefused, StoreConfig, StoreEntry

__all__ = [
    "CompileConfig",
    "CompileHooks",
    "CompileRecord",
    "CompileSession",
    "CompileStore",
    "DynamicSource",
    "EntryRefused",
    "FsspecBackend",
    "LocalBackend",
    "MemoryBackend",
    "StartupResult",
    "StoreBackend",
    "StoreConfig",
    "StoreEntry",
    "StoreKey",
    "TensorSpec",
    "autoinstall",
    "current_key",
    "current_session",
    "fast_start",
    "load_spec",
    "open_backend",
    "save_spec",
    "spec_of",
    "synthesize",
    "warm_up",
]

"""Every private torch API ettr calls, in one place, so that a torch release that moves one breaks one file.

Each function names the private thing it reaches, what ettr uses it for, and what it does when torch no
longer has it (raise ImportError for a part ettr cannot work without, else None or a safe answer). Nothing
here imports torch when this module is imported, and it imports nothing of ettr. Module *names* that ettr
watches for (`torch._dynamo` for the compile session's post-import hook, standbys' warm imports) are names,
not calls, and stay with their users.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

# -- torch.distributed.checkpoint ----------------------------------------------------------------------------


def fsspec_writer_class() -> Any:
    """DCP's `FsspecWriter` (`torch.distributed.checkpoint._fsspec_filesystem`): the writer of checkpoints
    on object stores. Raises ImportError without fsspec (or if DCP moved it)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter


def fsspec_reader_class() -> Any:
    """DCP's `FsspecReader`, the reader beside `fsspec_writer_class`. Raises ImportError."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def state_dict_stager_class() -> Any:
    """DCP's `StateDictStager` (`_state_dict_stager`): the staging copy `ReusedStager` falls back to (it caches
    its buffers the way DCP's async save does). Raises ImportError."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    return StateDictStager


def set_element(root: Any, path: Any, value: Any) -> None:
    """DCP's `_traverse.set_element`: put `value` at `path` of a nested state dict, as DCP's default load
    planner does for a flattened state dict (`SafeLoadPlanner`). Raises ImportError."""
    from torch.distributed.checkpoint._traverse import set_element as set_

    set_(root, path, value)


# -- inductor --------------------------------------------------------------------------------------------------


def inductor_cache_dir() -> str:
    """The cache directory inductor uses in this process (`_inductor.runtime.cache_dir_utils.cache_dir`;
    creates it, as inductor would). Raises ImportError."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return str(cache_dir())


def inductor_default_cache_dir() -> str:
    """Inductor's default cache directory (without `TORCHINDUCTOR_CACHE_DIR`). Raises ImportError."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return str(default_cache_dir())


def inductor_header_dir() -> str | None:
    """Where inductor keeps its precompiled headers (`codecache._HEADER_DIR`, fixed when its codecache module
    was imported); None when that module is not imported yet or has no such setting."""
    codecache = sys.modules.get("torch._inductor.codecache")
    header_dir = getattr(codecache, "_HEADER_DIR", None)
    return str(header_dir) if header_dir else None


def inductor_refix_header_dir() -> str | None:
    """Put inductor's precompiled-header directory (`codecache._HEADER_DIR` and its `_HEADER_LOCK_DIR`, fixed
    from TMPDIR when codecache was imported) where importing codecache now would put it, unless a header was
    looked up already (`_precompile_header`'s cache); the directory, or None when nothing was changed
    (codecache not imported, a header looked up, or inductor no longer has these settings)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if not all(
        isinstance(getattr(codecache, name, None), str) for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR")
    ):
        return None
    cache_info = getattr(getattr(codecache, "_precompile_header", None), "cache_info", None)
    if cache_info is None or cache_info().currsize > 0:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    header_dir = os.path.join(default_cache_dir(), "precompiled_headers")
    codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = header_dir, os.path.join(header_dir, "locks")  # type: ignore[union-attr]
    return header_dir


def inductor_probed_vec_isa(modules: Mapping[str, Any] | None = None) -> bool:
    """Whether this process's inductor probed the CPU's vector ISA (`cpu_vec_isa.valid_vec_isa_list`'s
    cache holds its answer: the probe builds a small library per ISA and loads it in a Python subprocess,
    ~1.2 s of CPU here, once per process that compiles CPU kernels). False when inductor changed and cannot
    tell."""
    module = (sys.modules if modules is None else modules).get("torch._inductor.cpu_vec_isa")
    cache_info = getattr(getattr(module, "valid_vec_isa_list", None), "cache_info", None)
    try:
        return cache_info is not None and cache_info().currsize > 0
    except Exception:
        return False


def inductor_vec_isa_module() -> Any:
    """`torch._inductor.cpu_vec_isa`, whose `valid_vec_isa_list` is inductor's CPU vector-ISA probe (cached for
    the process), after the modules the probe imports when it runs (`codecache`, `cpp_builder`), so that a
    helper thread running it imports nothing beside the program's own imports. Raises ImportError."""
    import importlib

    for name in ("torch._inductor.codecache", "torch._inductor.cpp_builder"):
        importlib.import_module(name)
    import torch._inductor.cpu_vec_isa as module

    return module


def inductor_vec_isa_memo_key() -> dict[str, str] | None:
    """What the answer of inductor's vector-ISA probe (`cpu_vec_isa.valid_vec_isa_list`) depends on beside
    the probe itself, read live and cheaply (one `<compiler> -v`): the CPU's ISA flags as torch reads them,
    the compiler and its version, torch's version and the libtorch the probe loads (size, mtime), the
    Python that loads it, the loader's path, and the probe's own code and per-ISA flags. None where the
    probe does not decide (`config.cpp.vec_isa_ok` set, fbcode) or is not the x86-64 Linux one. Raises
    ImportError (or what torch raises) when inductor moved what it reads."""
    import hashlib
    import os
    import platform

    import torch
    from torch._inductor import config, cpp_builder, cpu_vec_isa

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    if config.cpp.vec_isa_ok is not None or config.is_fbcode():
        return None
    libtorch = os.stat(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    compiler = cpp_builder.get_cpp_compiler()
    probe = cpu_vec_isa.VecISA._avx_code + "\0" + cpu_vec_isa.VecISA._avx_py_load
    # Per ISA its class's own flags and the code of its extra checks (avx512_bf16, amx_fp16), not the
    # instance's `build_arch_flags()`, which the probe itself changes (`_vec_isa_state`): the key is the same
    # read before and after a probe.
    flags = [
        f"{isa}={getattr(type(isa), '_arch_flags', '')}={isa.build_macro()}="
        + "\0".join(f"{name}:{code}" for name, code in sorted(_class_strings(type(isa), "_code")))
        for isa in cpu_vec_isa.supported_vec_isa_list
    ]
    return {
        "cpu_isa": " ".join(cpu_vec_isa.x86_isa_checker()),
        "compiler": f"{compiler} {cpp_builder.get_compiler_version_info(compiler)}",
        "torch": f"{torch.__version__} {getattr(torch.version, 'git_version', '')}",
        "libtorch": f"{libtorch.st_size}:{libtorch.st_mtime_ns}",
        "python": f"{os.path.realpath(sys.executable)} {sys.version}",
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
        "probe": hashlib.sha256((probe + "\n".join(flags)).encode()).hexdigest(),
    }


def inductor_codecache_module() -> Any:
    """`torch._inductor.codecache`, whose `_precompile_header` names (and builds) the precompiled header a
    C++ kernel compiles with. Raises ImportError."""
    from torch._inductor import codecache

    return codecache


def inductor_header_memo_key(header: str, include_env: Mapping[str, str]) -> dict[str, str] | None:
    """What inductor's preprocessing of `header` (`codecache._precompile_header`) reads beside its arguments,
    read live and cheaply (one `<compiler> -v`, cached by inductor): the compiler and its version, torch's
    version and its libtorch (size, mtime), the header's own file under torch's include directory (size,
    mtime), and `include_env` (the include paths the preprocessor takes from the environment). None when
    `header` is not a file of torch's include directory. Raises ImportError (or what torch raises) when
    inductor moved what it reads."""
    import os

    import torch
    from torch._inductor import cpp_builder

    include = os.path.join(os.path.dirname(torch.__file__), "include")
    path = os.path.normpath(os.path.join(include, header))
    if os.path.isabs(header) or not path.startswith(include + os.sep) or not os.path.isfile(path):
        return None
    own, libtorch = (
        os.stat(path),
        os.stat(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")),
    )
    compiler = cpp_builder.get_cpp_compiler()
    return {
        "compiler": f"{compiler} {cpp_builder.get_compiler_version_info(compiler)}",
        "torch": f"{torch.__version__} {getattr(torch.version, 'git_version', '')}",
        "libtorch": f"{libtorch.st_size}:{libtorch.st_mtime_ns}",
        # The file itself, not the name it was reached by: a venv linked into several worktrees is one torch.
        "header": f"{os.path.realpath(path)} {own.st_size}:{own.st_mtime_ns}",
        "include_env": " ".join(f"{k}={v}" for k, v in sorted(include_env.items())),
    }


VEC_ISA_STATE = re.compile(r"_is_[a-z0-9_]{1,40}_supported")
"""The instance attributes inductor's probe sets on an ISA it checks (`VecAVX512._is_avx512_bf16_supported`,
`VecAMX._is_amx_fp16_supported`): each adds a flag to the ISA's `build_arch_flags()`, so to the command line of
every C++ kernel, and so to the kernel's cache key and the precompiled header's name."""


def inductor_vec_isa_described(isa: Any) -> dict[str, Any]:
    """What a probe found of one of inductor's ISA objects, as plain data: its name, the flags it compiles
    with (`build_arch_flags()`), and the `VEC_ISA_STATE` attributes the probe set on it (True or False)."""
    return {"name": str(isa), "flags": isa.build_arch_flags(), "state": _vec_isa_state(isa)}


def _vec_isa_state(isa: Any) -> dict[str, bool]:
    names = {name for name, _ in _class_strings(type(isa), "", kind=bool)} | set(vars(isa))
    return {
        name: value
        for name in sorted(names)
        if VEC_ISA_STATE.fullmatch(name) and isinstance(value := getattr(isa, name, None), bool)
    }


def _class_strings(cls: type, suffix: str, *, kind: type = str) -> list[tuple[str, Any]]:
    """The class attributes of `cls` and its bases of type `kind` whose names end with `suffix`."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if name.endswith(suffix) and isinstance(value, kind) and not isinstance(value, type):
                found[name] = value
    return sorted(found.items())


def inductor_vec_isas_restored(described: list[dict[str, Any]]) -> list[Any] | None:
    """Inductor's ISA objects (`cpu_vec_isa.supported_vec_isa_list`) of `described` (each as
    `inductor_vec_isa_described` made it), in that order, as the probe returns them: each with the state the
    probe had set on it, so that it compiles with the same flags (checked: `build_arch_flags()` must come out
    as described). The memo is data someone else may have written: an ISA is taken only where this CPU has
    every feature its name lists (`x86_isa_checker`, the probe's own test), and a state only as False or where
    torch's own check of this CPU of the same name (`torch.cpu._is_amx_fp16_supported`) says True, so a
    forged memo cannot switch on instructions the CPU lacks (every kernel then dies of SIGILL). None, and
    nothing changed, when one is not (or no longer) inductor's, names a state its class does not have, is
    more than this CPU can run, or would compile with other flags."""
    import torch
    from torch._inductor import cpu_vec_isa

    names = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list]
    known = {
        n: isa
        for n, isa in zip(names, cpu_vec_isa.supported_vec_isa_list, strict=True)
        if names.count(n) == 1
    }
    found: list[Any] = [known.get(d.get("name", "")) for d in described]  # (a name two bear: not taken)
    if any(isa is None for isa in found):
        return None
    before = [(isa, dict(vars(isa))) for isa in found]
    try:
        cpu = set(cpu_vec_isa.x86_isa_checker())
        for isa, d in zip(found, described, strict=True):
            state = d.get("state", {})
            if set(state) - set(_vec_isa_state(isa)):
                raise ValueError("a state inductor does not set")
            if not set(str(isa).split()) <= cpu:
                raise ValueError("an ISA this CPU lacks")
            for name, value in state.items():
                if value is not False and not _cpu_check(torch.cpu, name):
                    raise ValueError("a state this CPU lacks")
            for name, value in state.items():
                setattr(isa, name, value)
            if isa.build_arch_flags() != d.get("flags"):
                raise ValueError("other flags")
    except Exception:
        for isa, attrs in before:
            for name in _vec_isa_state(isa):
                if name in attrs:
                    setattr(isa, name, attrs[name])
                elif name in vars(isa):
                    delattr(isa, name)
        return None
    return found


def _cpu_check(module: Any, name: str) -> bool:
    """What torch's check of this CPU named `name` says (`torch.cpu._is_amx_fp16_supported()`); False when
    torch has no such check (unknown is not True)."""
    check = getattr(module, name, None)
    try:
        return callable(check) and check() is True
    except Exception:
        return False


def probe_vec_isa() -> None:
    """Run inductor's vector-ISA probe now (`cpu_vec_isa.valid_vec_isa_list`, cached for the process), as the
    first CPU kernel compile would. Raises ImportError if inductor moved it."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list()


def inductor_used_precompiled_header() -> bool | None:
    """Whether this process's inductor used a precompiled header (`codecache._precompile_header`'s cache):
    False when inductor's codecache is not imported, None when inductor changed and cannot tell."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None:
        return False
    cache_info = getattr(getattr(codecache, "_precompile_header", None), "cache_info", None)
    if cache_info is None:
        return None
    return bool(cache_info().currsize > 0)


def inductor_kernel_template_class() -> Any:
    """`torch._inductor.codegen.common.KernelTemplate`, whose `_template_from_string` (a staticmethod) compiles
    the Jinja source of a kernel template. Raises ImportError, also when Jinja is not installed (inductor then
    has no templates to compile)."""
    import importlib.util

    if importlib.util.find_spec("jinja2") is None:
        raise ImportError("jinja2 is not installed")
    from torch._inductor.codegen.common import KernelTemplate

    return KernelTemplate


def prefetch_inductor_torch_key() -> bool:
    """Start computing inductor's `codecache.torch_key` (a hash of torch's source files, which the first
    compile's cache lookups need: ~0.15 s of CPU per process here, much of it reading and hashing, outside the
    GIL) on torch's own prefetch thread (`prefetch` of `torch.utils._functools.prefetchable_cache`; the first
    caller waits for that result rather than computing it again). Imports inductor's codecache. False when
    this torch's `torch_key` has no `prefetch`."""
    from torch._inductor import codecache

    prefetch = getattr(getattr(codecache, "torch_key", None), "prefetch", None)
    if prefetch is None:
        return False
    prefetch()
    return True


def inductor_config() -> Any:
    """`torch._inductor.config` (its portable settings key the compile store). Raises ImportError."""
    from torch._inductor import config

    return config


# -- dynamo ----------------------------------------------------------------------------------------------------


def dynamo_callback_handler() -> Any:
    """Dynamo's `callback_handler` (`torch._dynamo.callback`): start and end callbacks around every
    compilation (imports `torch._dynamo`). Raises ImportError."""
    from torch._dynamo.callback import callback_handler

    return callback_handler


def dynamo_recompile_reason() -> str | None:
    """Why Dynamo is compiling now, if it recompiles (set in its metrics context before the compile callbacks
    run: `convert_frame._compile`); None when it says nothing or cannot be read."""
    try:
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
        return None if reason is None else str(reason)
    except Exception:
        return None


def dynamo_frames_compiled() -> int | None:
    """How many frames Dynamo has compiled in this process (`torch._dynamo.utils.counters`), without
    importing Dynamo: 0 when it is not imported, None when its counters cannot be read."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0
    try:
        return int(dynamo_utils.counters["frames"]["total"])
    except Exception:
        return None


def pgo_profile() -> tuple[Mapping[Any, Any], Any]:
    """Dynamo's profile-guided dynamism (`torch._dynamo.pgo`): this process's code states (`_CODE_STATE`,
    empty when none) and the `auto_dynamic` marker its entries carry. Raises ImportError (or
    AttributeError when pgo changed)."""
    from torch._dynamo import pgo

    return pgo._CODE_STATE or {}, pgo.auto_dynamic


# -- torch.utils.data, torch.distributed -------------------------------------------------------------------------


def dataloader_iter_base() -> Any:
    """`torch.utils.data.dataloader._BaseDataLoaderIter`: the one `__next__` every DataLoader iterator
    shares (the bootstrap times the first batch there)."""
    import torch.utils.data.dataloader as dataloader

    return dataloader._BaseDataLoaderIter


def dataloader_worker_iter() -> Any:
    """`torch.utils.data.dataloader._MultiProcessingDataLoaderIter` (None where this torch has none): its
    `_get_data` is the wait for a batch from the worker processes."""
    import torch.utils.data.dataloader as dataloader

    cls = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    return cls if callable(getattr(cls, "_get_data", None)) else None


def default_store() -> Any:
    """The default process group's store (`distributed_c10d._get_default_store`)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def default_group() -> Any:
    """The default process group (`distributed_c10d._get_default_group`), None when there is none."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def next_group_name() -> str | None:
    """The name torch gives the next `new_group` (`distributed_c10d._world.group_count`, as
    `_process_group_name` makes it); None where torch no longer keeps it."""
    import torch.distributed as dist

    count = getattr(getattr(dist.distributed_c10d, "_world", None), "group_count", None)
    return str(count) if isinstance(count, int) else None


def gloo_rendezvous_keys(group_name: str, rank: int) -> list[str]:
    """The keys, in `default_store()`, where a gloo group named `group_name` publishes `rank`'s address while
    it forms (`_new_process_group_helper`'s `<name>/` and `cpu/` prefixes, then gloo's per-device index:
    one device, or one per `GLOO_SOCKET_IFNAME` interface). A torch that renamed them makes these names
    miss (tests/test_agent_store_groups.py checks that they are written)."""
    import os

    devices = len([name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]) or 1
    return [f"{group_name}//cpu//{index}/{rank}" for index in range(devices)]


def group_timeout_s(group: Any = None) -> float | None:
    """The timeout of `group` (None: the default group) in seconds as its CPU backend has it now (after
    `set_group_timeout` too: `ProcessGroup._get_backend(cpu).options._timeout`); None where torch does not
    say (no group, another backend, a torch that moved it)."""
    try:
        import torch
        import torch.distributed as dist

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # not a guess: the caller keeps what it did without one
        return None


def set_group_timeout(seconds: float, group: Any = None) -> bool:
    """Set the timeout of `group` (None: the default group) after it was made
    (`distributed_c10d._set_pg_timeout`): a group is formed under one bound and runs its collectives under
    another. False when torch no longer has it (the group keeps the timeout it was made with)."""
    import datetime

    import torch.distributed as dist

    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return False
    set_timeout(datetime.timedelta(seconds=seconds), group)
    return True

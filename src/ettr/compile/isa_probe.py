"""Inductor's CPU vector-ISA probe: one answer per process, shared under a lock, remembered in inductor's cache
directory, and run ahead on the compile session's restore thread.

A process's first CPU kernel compile probes the CPU's vector ISAs (`cpu_vec_isa.valid_vec_isa_list`): it
builds a small library per ISA into inductor's cache directory and loads each in a Python subprocess (libtorch
loaded six times: ~1.3 s of CPU per process here), and the compiling thread waits for it. `share` wraps the
probe so that

* concurrent callers share one run: a compile that needs the answer while the restore thread still probes
  waits for that probe rather than starting a second one (inductor caches the answer with
  `functools.cache`, which holds no lock);
* the answer is remembered in inductor's cache directory (`MEMO_NAME`, written whole), with everything it
  depends on (`torch_compat.inductor_vec_isa_memo_key`: the CPU's ISA flags, the compiler and its version,
  torch and the libtorch the probe loads, the Python, the probe's code); a later process whose key is the
  same to the letter takes the remembered answer instead of probing again. The compile store carries that
  file with the rest of the cache directory, so later attempts and jobs of the workload find it. It is
  data, never run: per valid ISA its name, which must still be one of inductor's and which the probe had
  found this CPU's ISA flags to allow under the same key (a name the key's CPU lacks cannot pass), the
  flags it compiles with, and what the probe set on inductor's ISA object beside its answer
  (`torch_compat.VEC_ISA_STATE`: whether avx512_bf16 and amx_fp16 build here). That state is put back on
  the object, and the answer taken only if the object then compiles with the remembered flags. Before
  (schema 1: names only) a remembered AVX-512 or AMX ISA lacked `-mavx512bf16`, which the probe adds on a
  CPU that has it: every C++ kernel of a process that recalled had another command line than one that
  probed, so another cache key and another precompiled header, and the kernels the store held from the
  other kind of process were all compiled again (measured in the demo: 9 kernels and a 156 MB header,
  5.8 s of the compilers' CPU in attempt 0 and again in the in-place replacement).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ettr import torch_compat
from ettr.atomic import atomic_write
from ettr.patcher import ORIGINAL_ATTR, Patcher
from ettr.untrusted import read_json_file

logger = logging.getLogger("ettr")

MEMO_NAME = "ettr-vec-isa.json"
"""The remembered answer, in inductor's cache directory."""
MEMO_SCHEMA = "ettr.vec-isa/2"
"""2: each valid ISA with its flags and state (1: names only, no longer taken)."""
MEMO_MAX_BYTES = 64 * 1024
MAX_ISAS = 32
MAX_STATE = 8
"""The most state attributes one remembered ISA may name."""

MemoDir = Callable[[], Path | None]
"""Where the answer is remembered, looked up when the probe runs (None: nowhere)."""


def share(patcher: Patcher, memo_dir: MemoDir | None = None) -> bool:
    """Wrap inductor's probe (see the module docstring); whether it is wrapped now (False: inductor moved it).
    `memo_dir` defaults to inductor's cache directory at the time of the probe. The wrapper keeps the
    cache's `cache_info` and `cache_clear`, which `torch_compat.inductor_probed_vec_isa` reads (a
    remembered answer leaves that cache empty: a standby then does not probe ahead, and needs not).
    Imports inductor's codecache (the probe's)."""
    try:
        module = torch_compat.inductor_vec_isa_module()
    except ImportError as exc:
        logger.debug("ettr: inductor's ISA probe not shared (%s)", exc)
        return False
    where = memo_dir if memo_dir is not None else _inductor_cache_dir
    patcher.wrap(module, "valid_vec_isa_list", lambda probe: _shared(probe, where))
    return getattr(getattr(module, "valid_vec_isa_list", None), ORIGINAL_ATTR, None) is not None


def run() -> None:
    """Run the (shared) probe now; never raises (the first compile then probes, as it would have)."""
    try:
        torch_compat.probe_vec_isa()
    except Exception as exc:
        logger.debug("ettr: inductor's ISA probe not run ahead (%s)", exc)


def _shared(probe: Callable[[], Any], memo_dir: MemoDir) -> Callable[[], Any]:
    lock = threading.RLock()  # re-entrant: the probe of one thread never waits for itself
    answer: list[Any] = []

    def shared_probe() -> Any:
        with lock:
            if not answer:
                answer.append(_probe_or_recall(probe, memo_dir))
            return answer[0]

    for name in ("cache_info", "cache_clear"):  # methods of the cache, which `update_wrapper` does not copy
        if hasattr(probe, name):
            setattr(shared_probe, name, getattr(probe, name))
    return shared_probe


def _probe_or_recall(probe: Callable[[], Any], memo_dir: MemoDir) -> Any:
    try:
        if probe.cache_info().currsize > 0:  # type: ignore[attr-defined]  # probed already (a standby)
            return probe()
    except Exception:
        pass
    try:
        key, directory = torch_compat.inductor_vec_isa_memo_key(), memo_dir()
    except Exception as exc:
        logger.debug("ettr: inductor's ISA probe not remembered (%s)", exc)
        key, directory = None, None
    if key is None or directory is None:
        return probe()
    path = directory / MEMO_NAME
    described = recall(path, key)
    if described is not None:
        isas = torch_compat.inductor_vec_isas_restored(described)
        if isas is not None:
            return isas
    result = probe()
    try:
        remember(path, key, [torch_compat.inductor_vec_isa_described(isa) for isa in result])
    except Exception as exc:
        logger.debug("ettr: inductor's ISA probe answer not kept (%s)", exc)
    return result


def recall(path: Path, key: dict[str, str]) -> list[dict[str, Any]] | None:
    """The valid ISAs remembered at `path` under exactly `key` (each {"name", "flags", "state"}); None when
    there is no such answer (missing, unreadable, malformed, of schema 1, or made under another key)."""
    try:
        memo = read_json_file(path, MEMO_MAX_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(memo, dict) or memo.get("schema") != MEMO_SCHEMA or memo.get("key") != key:
        return None
    valid = memo.get("valid")
    if not isinstance(valid, list) or len(valid) > MAX_ISAS or not all(_well_formed(d) for d in valid):
        return None
    return [{"name": d["name"], "flags": d["flags"], "state": dict(d["state"])} for d in valid]


def _well_formed(described: Any) -> bool:
    if not isinstance(described, dict) or set(described) != {"name", "flags", "state"}:
        return False
    state = described["state"]
    return (
        isinstance(described["name"], str)
        and isinstance(described["flags"], str)
        and isinstance(state, dict)
        and len(state) <= MAX_STATE
        and all(isinstance(k, str) and isinstance(v, bool) for k, v in state.items())
    )


def remember(path: Path, key: dict[str, str], valid: list[dict[str, Any]]) -> None:
    """Keep the probe's answer at `path` (written whole): each valid ISA as
    `torch_compat.inductor_vec_isa_described` gives it; never raises."""
    try:
        memo = {"schema": MEMO_SCHEMA, "key": key, "valid": valid}
        atomic_write(path, json.dumps(memo, sort_keys=True, indent=1), mode=0o600, durable=False)
    except Exception as exc:
        logger.debug("ettr: inductor's ISA probe answer not kept (%s)", exc)


def _inductor_cache_dir() -> Path | None:
    return Path(torch_compat.inductor_cache_dir())

"""The compatibility key of compile artifacts: what must match for a stored entry to be loadable.

Compiled kernels, AOTAutograd graphs and PGO profiles are only valid for the torch build, Python,
platform, device and inductor configuration that produced them. The key names all of these plus a
user key (the workload), and its digest names the entry in the store; a loaded manifest must carry the
same components, so an entry written by anything else is never used.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Any

from ettr import torch_compat

KEY_VERSION = 1
"""Bumped when the meaning of a component changes (entries of another version never match)."""

HEADERS_USER_KEY = "ettr:precompiled-headers"
"""The user key of a build's precompiled-header entry (`StoreKey.headers_key`): the same for every workload."""


@dataclass(frozen=True, kw_only=True)
class StoreKey:
    """Everything that makes compile artifacts compatible. All fields are plain strings."""

    torch_version: str
    """`torch.__version__` plus the git revision of the build."""
    python_version: str
    """Implementation and full version, e.g. `cpython-3.11.7`."""
    platform: str
    """OS, machine and C library, e.g. `linux-x86_64-glibc2.36`."""
    device_type: str
    """`cpu`, or `cuda-<cuda version>-<device name>-sm<capability>` (kernels are built for one device)."""
    inductor_config: str
    """Digest of inductor's portable configuration (a changed option means other kernels)."""
    user_key: str = ""
    """The workload: jobs with the same user key share profiles and kernels."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, str):
                raise ValueError(f"StoreKey.{name} must be a string, not {type(value).__name__}")

    def components(self) -> dict[str, str]:
        """The key as a JSON-ready mapping (what manifests record and loads compare)."""
        return {"key_version": str(KEY_VERSION), **asdict(self)}

    def headers_key(self) -> StoreKey:
        """The key of this build's precompiled headers: every component but the workload. Inductor's header
        is the same for every model of one torch/compiler build, so it is stored, and restored, per build."""
        return StoreKey(
            torch_version=self.torch_version,
            python_version=self.python_version,
            platform=self.platform,
            device_type=self.device_type,
            inductor_config=self.inductor_config,
            user_key=HEADERS_USER_KEY,
        )

    @property
    def digest(self) -> str:
        """Stable name of the entry: the first 32 hex digits of a SHA-256 over the components."""
        canonical = json.dumps(self.components(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _platform_tag() -> str:
    libc, libc_version = platform.libc_ver()
    libc_tag = f"-{libc}{libc_version}" if libc else ""
    return f"{sys.platform}-{platform.machine()}{libc_tag}"


def _python_tag() -> str:
    impl = sys.implementation
    version = ".".join(str(part) for part in sys.version_info[:3])
    return f"{impl.name}-{version}"


def _device_tag(device_type: str) -> str:
    if device_type != "cuda":
        return device_type
    import torch

    try:
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index).replace(" ", "_")
        return f"cuda-{torch.version.cuda}-{name}-sm{major}{minor}"
    except Exception:  # no usable device: the build's CUDA version is all we know
        return f"cuda-{torch.version.cuda}"


def inductor_config_digest() -> str:
    """Digest of `torch._inductor.config`'s portable settings (imports inductor's config module)."""
    inductor_config = torch_compat.inductor_config()
    portable: dict[str, Any] = inductor_config.save_config_portable()
    canonical = json.dumps(portable, sort_keys=True, default=repr)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def current_key(*, user_key: str = "", device_type: str | None = None) -> StoreKey:
    """The key of artifacts this process would produce (imports torch).

    `device_type` defaults to `cuda` when a CUDA device is usable, else `cpu`.
    """
    import torch

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    git_version = getattr(torch.version, "git_version", "") or ""
    return StoreKey(
        torch_version=f"{torch.__version__}+{git_version[:12]}" if git_version else torch.__version__,
        python_version=_python_tag(),
        platform=_platform_tag(),
        device_type=_device_tag(device_type),
        inductor_config=inductor_config_digest(),
        user_key=user_key,
    )

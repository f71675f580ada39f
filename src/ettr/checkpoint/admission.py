"""Whether an intact checkpoint may be loaded here: who signed it, and which root it was written into.

Integrity (`commit.verify`: sizes, CRC-32s) says a checkpoint is whole; this says whether to believe it.
`Admission.check` is asked about each manifest before any of its files is read:

* signed with a key of this ring (`keys.KeyRing`): its HMAC must verify, else it is forged or corrupt
  (CheckpointInvalid: moved aside like a corrupt one);
* signed with a key the ring does not hold, or unsigned in a root this user signed checkpoints in (the
  ring's registry, kept outside the root): refused (CheckpointRefused: left where it is) unless
  `allow_unsigned` — the explicit downgrade;
* unsigned in a root never signed (written before ettr signed, or by a process without any key): loaded,
  and said so — the first signed save then registers the root, and from then on unsigned is refused;
* written into another root than this one (copied or moved in from another job): refused unless
  `resume_foreign`.

However it is answered, loading never unpickles anything as code (`trust`): the signature decides whose
weights are loaded, not whether a checkpoint can run code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ettr.checkpoint.base import CheckpointInvalid, CheckpointRefused
from ettr.checkpoint.commit import Manifest
from ettr.checkpoint.keys import KEY_DIR_ENV, SECRET_ENV, KeyRing

logger = logging.getLogger("ettr")

ALLOW_UNSIGNED_ENV = "ETTR_CHECKPOINT_ALLOW_UNSIGNED"
"""`1`: load checkpoints without authentication (unsigned, or signed with a key the ring lacks)."""
RESUME_FOREIGN_ENV = "ETTR_CHECKPOINT_RESUME_FOREIGN"
"""`1`: resume from a checkpoint written into another root."""


def env_flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether an on/off environment variable is on (`1`, `true`, `yes`, `on`)."""
    value = (os.environ if env is None else env).get(name, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Verdict:
    """What `Admission.check` concluded about a checkpoint it admitted."""

    authenticated: bool
    """Signed with a key of this ring, and the signature verified."""
    signer: str | None = None
    """The id of the key that signed it (authenticated only)."""
    note: str = ""
    """Why it was admitted without authentication ("" when authenticated)."""


@dataclass(frozen=True, kw_only=True)
class Admission:
    """The rules a checkpoint of `root` must pass here (see the module docstring).

    Args:
        ring: the keys that verify, and the registry of signed roots.
        root: this root's identity (`commit.root_identity`).
        allow_unsigned: admit unsigned checkpoints, and those of keys the ring lacks, unauthenticated.
        resume_foreign: admit checkpoints whose manifest names another root.
        what: the word messages use ("checkpoint", "anchor").
    """

    ring: KeyRing
    root: str
    allow_unsigned: bool = False
    resume_foreign: bool = False
    what: str = "checkpoint"

    def __call__(self, manifest: Manifest) -> Verdict:
        return self.check(manifest)

    def check(self, manifest: Manifest) -> Verdict:
        """Admit `manifest` (returns how) or raise: CheckpointInvalid for a forged signature,
        CheckpointRefused for one not to be loaded unless asked."""
        verdict = self._signature(manifest)
        if manifest.root is not None and manifest.root != self.root and not self.resume_foreign:
            job = f"job {manifest.job_id!r}" if manifest.job_id else "another job"
            raise CheckpointRefused(
                f"written by {job} into {manifest.root}, not this root {self.root} (copied in from another "
                f"job?); to resume from it, set {RESUME_FOREIGN_ENV}=1 or CheckpointConfig(resume_foreign=True)"
            )
        return verdict

    def _signature(self, manifest: Manifest) -> Verdict:
        downgrade = f"set {ALLOW_UNSIGNED_ENV}=1 (or allow_unsigned) to load it without authentication"
        if manifest.signature is not None:
            if manifest.key_id is not None:
                key = self.ring.keys.get(manifest.key_id)
                if key is not None:
                    if not manifest.signed_with(key):
                        raise CheckpointInvalid(
                            f"its HMAC does not verify with key {manifest.key_id} (forged or corrupt)"
                        )
                    return Verdict(authenticated=True, signer=manifest.key_id)
                unknown = (
                    f"signed with key {manifest.key_id}, which this key ring ({self._ring_where()}) lacks"
                )
            else:  # signed by an ettr that did not name its keys: any key of the ring may be it
                for kid, key in self.ring.keys.items():
                    if manifest.signed_with(key):
                        return Verdict(authenticated=True, signer=kid)
                unknown = f"signed with a key this key ring ({self._ring_where()}) lacks, or forged"
            if self.allow_unsigned:
                return Verdict(authenticated=False, note=f"{unknown}; loaded without authentication")
            raise CheckpointRefused(
                f"{unknown}: give its key ({SECRET_ENV}, or its .key file in {KEY_DIR_ENV}), or {downgrade}"
            )
        if self.allow_unsigned:
            return Verdict(authenticated=False, note="unsigned; loaded without authentication (allowed)")
        if self.ring.is_signed_root(self.root):
            raise CheckpointRefused(
                f"unsigned, in a root whose {self.what}s this user signed (forged, or written without a key); "
                f"{downgrade}"
            )
        if self.ring.signing is None:
            return Verdict(authenticated=False, note="unsigned; this process has no key to check it with")
        return Verdict(
            authenticated=False,
            note="unsigned, in a root never signed (written before ettr signed checkpoints); "
            "later saves are signed",
        )

    def _ring_where(self) -> str:
        return str(self.ring.directory) if self.ring.directory is not None else "no key directory"

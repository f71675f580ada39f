"""The checkpoint side's name for the user's key ring (`ettr.keyring`, which lives outside this package so
that `ettr fleet` can verify a summary's signature without importing torch)."""

from ettr.keyring import (
    KEY_DIR_ENV,
    SECRET_ENV,
    KeyRing,
    key_dir,
    key_id,
    new_signing_key,
    root_digest,
)

__all__ = ["KEY_DIR_ENV", "SECRET_ENV", "KeyRing", "key_dir", "key_id", "new_signing_key", "root_digest"]

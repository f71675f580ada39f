"""`ettr.errors.describe_os_error`: the one way ettr names an I/O error, for the supervisor's lines and the
checkpoint's errors alike."""

from __future__ import annotations

import errno
import sqlite3

from ettr.errors import describe_os_error


def test_an_os_error_is_named_by_its_errno_with_its_file():
    assert describe_os_error(OSError(errno.ENOSPC, "No space left on device", "/ckpt/x")) == (
        "ENOSPC (No space left on device): /ckpt/x"
    )
    said = describe_os_error(OSError(errno.EIO, "injected", "/d"))
    assert said == "EIO (Input/output error): injected: /d"  # a message of its own is kept


def test_sqlite_s_full_disk_is_said_as_enospc_and_anything_else_as_type_and_message():
    full = describe_os_error(sqlite3.OperationalError("database or disk is full"))
    assert full.startswith("ENOSPC (No space left on device)") and "database or disk is full" in full
    assert describe_os_error(ValueError("bad")) == "ValueError: bad"
    assert describe_os_error(OSError("no errno")) == "OSError: no errno"

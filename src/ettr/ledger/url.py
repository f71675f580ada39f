"""Ledger URLs: `sqlite:///PATH` (one job's SQLite file) and `postgresql://...` (many jobs on a server).

    open_url(url, job_id=..., create=...)   the job's ledger, for reading (reports, fleet) or writing
    list_jobs(url)                          the job ids a ledger holds
    open_for_run(url, job_id=..., run_dir=...)   what `ettr run` and its training processes write through:
                                            a PostgreSQL ledger is wrapped in `SpillingLedger`

Every failure is an `ettr.errors.UsageError` with one line (password redacted): unknown scheme, missing
file, unreachable server, wrong password, unknown job, a schema from a newer ettr.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import unquote

from ettr.atomic import atomic_write
from ettr.errors import UsageError
from ettr.ledger.base import Ledger, LedgerError
from ettr.ledger.locate import POINTER_FILENAME, read_pointer
from ettr.ledger.postgres import CALL_TIMEOUT_S, PostgresLedger, redact
from ettr.ledger.postgres import list_jobs as _postgres_jobs
from ettr.ledger.sqlite import LEDGER_FILENAME, SqliteLedger

POSTGRES_SCHEMES = ("postgresql", "postgres")
TRAINING_CALL_TIMEOUT_S = 5.0
"""A training process's bound on one call to the server (`PostgresLedger.call_timeout_s`): its events are
appended in batches that take milliseconds, and its exit waits for the call in flight, so a stalled server
costs it at most this before its events go to the spill file."""


def scheme_of(url: str) -> str:
    """`sqlite` or `postgresql` for a URL ettr can open. Raises `UsageError`."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "sqlite":
        return "sqlite"
    if scheme in POSTGRES_SCHEMES:
        return "postgresql"
    raise UsageError(
        f"ledger URL {redact(url)!r}: unknown scheme {scheme or '(none)'!r} "
        "(give sqlite:///PATH or postgresql://USER@HOST[:PORT]/DBNAME)"
    )


def sqlite_path(url: str) -> Path:
    """The file of a `sqlite:///PATH` URL: PATH relative to the current directory, absolute with a fourth
    slash (`sqlite:////abs/ledger.db`, as in SQLAlchemy); a run directory means its ledger.db. Raises
    `UsageError`."""
    prefix = "sqlite:///"
    if not url.lower().startswith(prefix):
        raise UsageError(f"ledger URL {url!r}: a SQLite ledger is a local file (write sqlite:///PATH)")
    text = unquote(url[len(prefix) :])
    if not text.strip("/"):
        raise UsageError(f"ledger URL {url!r} names no file (write sqlite:///PATH/TO/ledger.db)")
    if "\x00" in text:
        raise UsageError(f"ledger URL {url!r}: a path cannot hold a NUL byte (%00)")
    path = Path(text)
    if path.is_dir():
        return path / LEDGER_FILENAME
    for parent in path.parents:  # `sqlite:///afile/x.db` under a regular file: say so, not "File exists"
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise UsageError(
                    f"ledger URL {url!r}: {parent} is not a directory (give a path under a folder: "
                    "sqlite:///DIR/ledger.db)"
                )
            break
    return path


def _sqlite(url: str, *, job_id: str, create: bool) -> SqliteLedger:
    path = sqlite_path(url)
    if not create and not os.path.lexists(path):
        raise UsageError(f"ledger {url}: no such file {path}")
    try:
        ledger = SqliteLedger(path, create=create)
    except (LedgerError, OSError) as exc:
        raise UsageError(f"ledger {url}: {exc}") from None
    held = ledger.job_id()
    if held is not None and held != job_id:
        ledger.close()
        raise UsageError(f"ledger {url} holds job {held!r}, not {job_id!r} (a SQLite ledger holds one job)")
    return ledger


def _postgres(url: str, **kwargs: object) -> PostgresLedger:
    try:
        return PostgresLedger(url, **kwargs)  # type: ignore[arg-type]
    except LedgerError as exc:
        raise UsageError(f"{exc} (check the URL, the server and the password)") from None
    except ImportError:
        raise UsageError(
            "a postgresql:// ledger needs psycopg 3 (install it: pip install 'psycopg[binary]>=3.1')"
        ) from None


def open_url(url: str, *, job_id: str, create: bool = False) -> SqliteLedger | PostgresLedger:
    """The ledger of job `job_id` at `url`; `create` makes the file or schema and registers the job.
    Raises `UsageError` (one line)."""
    if not job_id:
        raise UsageError("a ledger URL needs a job id (give --job-id)")
    if scheme_of(url) == "sqlite":
        return _sqlite(url, job_id=job_id, create=create)
    return _postgres(url, job_id=job_id, create=create)


def list_jobs(url: str) -> list[str]:
    """The ids of the jobs the ledger at `url` holds, oldest first. Raises `UsageError`."""
    if scheme_of(url) == "sqlite":
        path = sqlite_path(url)
        if not os.path.lexists(path):
            raise UsageError(f"ledger {url}: no such file {path}")
        try:
            ledger = SqliteLedger(path, create=False)
        except LedgerError as exc:
            raise UsageError(f"ledger {url}: {exc}") from None
        try:
            held = ledger.job_id()
        finally:
            ledger.close()
        return [] if held is None else [held]
    try:
        return _postgres_jobs(url)
    except LedgerError as exc:
        raise UsageError(f"{exc} (check the URL, the server and the password)") from None


def open_for_run(
    url: str | None,
    *,
    job_id: str,
    run_dir: str | os.PathLike[str],
    supervisor: bool,
    retry_interval_s: float = 2.0,
) -> Ledger:
    """The ledger one process of a running job writes through (`ettr.ledger.locate`'s rule for writers).

    No URL: the run directory's own SQLite file. A SQLite URL: that file. PostgreSQL: a `SpillingLedger`
    spilling to `run_dir`. The supervisor's (`supervisor=True`) creates the schema and the job, needs the
    server now (it reads the job's history; `UsageError` otherwise), delivers orphaned spill files and
    leaves the pointer (`ledger-url.json`) that lets `ettr report RUN_DIR` find the books; a training
    process's never fails for the server (recording spills until it answers). Raises `UsageError`.
    """
    if url is None:
        from ettr.ledger.locate import ledger_path

        try:
            return SqliteLedger(ledger_path(run_dir), create=True)
        except (LedgerError, OSError) as exc:
            raise UsageError(f"{run_dir}: {exc}") from None
    if scheme_of(url) == "sqlite":
        ledger: Ledger = _sqlite(url, job_id=job_id, create=True)
    else:
        ledger = _spilling(
            url, job_id=job_id, run_dir=run_dir, supervisor=supervisor, retry_interval_s=retry_interval_s
        )
    if supervisor:  # after the books opened: a URL that cannot be used leaves no pointer to nothing behind
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            write_pointer(run_dir, url, job_id=job_id)
        except OSError as exc:
            ledger.close()
            raise UsageError(f"cannot write {Path(run_dir) / POINTER_FILENAME} ({exc})") from None
    return ledger


def _spilling(
    url: str, *, job_id: str, run_dir: str | os.PathLike[str], supervisor: bool, retry_interval_s: float
) -> Ledger:
    """`open_for_run`'s PostgreSQL ledger: a `SpillingLedger` spilling to `run_dir`."""
    from ettr.ledger.spill import SpillingLedger, spill_dir

    node = socket.gethostname()
    first = _postgres(url, job_id=job_id, create=True, run_dir=run_dir, node=node) if supervisor else None

    def connect() -> PostgresLedger:
        nonlocal first
        if first is not None:
            made, first = first, None
            return made
        return PostgresLedger(
            url,
            job_id=job_id,
            create=True,
            run_dir=run_dir,
            node=node,
            call_timeout_s=CALL_TIMEOUT_S if supervisor else TRAINING_CALL_TIMEOUT_S,
        )

    return SpillingLedger(
        connect,
        job_id=job_id,
        spill_dir=spill_dir(run_dir),
        node=node,
        adopt_orphans=supervisor,
        retry_interval_s=retry_interval_s,
        background_connect=not supervisor,
    )


def write_pointer(run_dir: str | os.PathLike[str], url: str, *, job_id: str) -> None:
    """Record in `run_dir` where its books are: the URL without its password (libpq takes that from
    PGPASSWORD or ~/.pgpass), a SQLite path made absolute."""
    if scheme_of(url) == "sqlite":
        url = "sqlite:///" + str(sqlite_path(url).absolute())
    else:
        url = redact(url, mask=None)
    payload = json.dumps({"url": url, "job_id": job_id}) + "\n"
    atomic_write(Path(run_dir) / POINTER_FILENAME, payload)


__all__ = [
    "POINTER_FILENAME",
    "list_jobs",
    "open_for_run",
    "open_url",
    "read_pointer",
    "scheme_of",
    "sqlite_path",
    "write_pointer",
]

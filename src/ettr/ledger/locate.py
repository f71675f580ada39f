"""Where a run's books are: the one rule every reader and writer of a run directory follows.

A run directory keeps its books in one of two places:
- its own SQLite file, `RUN_DIR/ledger.db` (the default);
- a ledger URL (`ettr run --ledger URL`), named by the pointer `RUN_DIR/ledger-url.json` (`{"url", "job_id"}`,
  left by the supervisor) and, inside the job, by `ETTR_LEDGER` (with `ETTR_JOB_ID`).

Readers (`locate`): inside the job (`ETTR_RUN_DIR` is this very directory and `ETTR_LEDGER` is set) the URL
of the environment; else the run directory's own file when it has one; else its pointer. Writers
(`ettr.ledger.url.open_for_run`): the URL when one is given, else the run directory's own file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ettr.events import Event
from ettr.ledger.base import Ledger, LedgerError, LedgerMark
from ettr.ledger.sqlite import LEDGER_FILENAME, SqliteLedger

POINTER_FILENAME = "ledger-url.json"
"""Left in a run directory whose books are at a URL, so that `ettr report RUN_DIR` finds them."""


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where the run directory's own ledger (SQLite) lives."""
    return Path(run_dir) / LEDGER_FILENAME


def pointer_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / POINTER_FILENAME


def read_pointer(run_dir: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(url, job_id) of a run directory whose books are at a URL; None if it has no readable pointer."""
    from ettr.untrusted import read_json_file

    try:  # never through a symlink, never a FIFO (it would block), at most 64 KiB
        found = read_json_file(pointer_path(run_dir), 65536)
        url, job_id = found["url"], found["job_id"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    if not isinstance(url, str) or not isinstance(job_id, str) or not url or not job_id:
        return None
    return untrusted_server_url(url), job_id


UNTRUSTED_AUTH = "!password"
"""libpq's `require_auth` for a server named by a file on disk: never send the password in clear text."""


UNTRUSTED_KEYS = frozenset(
    {
        "host", "hostaddr", "port", "dbname", "user", "password",  # the server and account it names
        "connect_timeout", "application_name", "target_session_attrs", "load_balance_hosts",
        "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout",
        "sslmode", "channel_binding", "gssencmode", "ssl_min_protocol_version", "ssl_max_protocol_version",
    }
)  # fmt: skip
"""The libpq parameters a URL read from a run directory keeps: those that name the server and bound the
connection. The others name files on this machine that libpq reads, writes or loads: `sslkey=ENGINE:KEY`
makes OpenSSL load ENGINE (an absolute path: a shared library, its code run at load), `sslkeylogfile`
appends TLS secrets to any file, `sslcert`/`sslrootcert`/`sslcrl`/`passfile`/`service` read files (a FIFO
blocks); `options` and `krbsrvname` reach the server's or Kerberos's configuration."""


def untrusted_server_url(url: str) -> str:
    """`url` as read from a run directory (which anyone who could write there may have forged). A PostgreSQL
    URL keeps only the query parameters in `UNTRUSTED_KEYS` (nothing it names is loaded, read or written on
    this machine) and gets `require_auth=!password`, so that a forged pointer to someone's server never makes
    libpq hand it PGPASSWORD (or a ~/.pgpass entry) in clear text; other URLs as they are. A run whose books
    need client certificates is read with `--ledger URL`, which is trusted as given."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    if not url.lower().startswith(("postgresql://", "postgres://")):
        return url
    try:
        parts = urlsplit(url)
        query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k in UNTRUSTED_KEYS]
    except ValueError:
        return url  # not a URL libpq would take either: opening it fails with one line
    query.append(("require_auth", UNTRUSTED_AUTH))
    # Assembled by hand: `urlunsplit` drops an empty host (`postgresql:///db`, the local socket)
    return f"{parts.scheme}://{parts.netloc}{parts.path}?{urlencode(query, safe='!')}"


def unsearchable(path: str | os.PathLike[str]) -> str | None:
    """Why nothing inside the directory `path` can be looked up (`permission denied`: a run directory of
    another user, mode 0700), or None. `is_run_dir` cannot tell such a directory from one that keeps no books
    (the lookup of `ledger.db` fails either way): a reader says this instead of "not an ettr run directory"
    or, in a fleet, passing over it in silence."""
    try:
        os.lstat(ledger_path(path))
    except PermissionError as exc:
        return f"{path}: {(exc.strerror or 'permission denied').lower()} (this user cannot look inside it)"
    except (OSError, ValueError):  # missing, not a directory, a NUL in the name: the caller says that
        pass
    return None


def is_run_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` keeps a run's books (its own ledger file, or a pointer to a URL). Anything by those names
    counts (a FIFO, a directory): reading it then says what is wrong, instead of passing over it in silence."""
    return os.path.lexists(ledger_path(path)) or os.path.lexists(pointer_path(path))


@dataclass(frozen=True, slots=True)
class Books:
    """Where one run's events are: the run directory's own SQLite file (`url` None) or job `job_id` of the
    ledger at `url`."""

    run_dir: Path
    url: str | None = None
    job_id: str | None = None

    @property
    def where(self) -> str:
        """For messages: the file, or the URL (password hidden) and job."""
        if self.url is None:
            return str(ledger_path(self.run_dir))
        from ettr.ledger.postgres import redact

        return f"{redact(self.url)} job {self.job_id}"

    def open(self) -> Ledger:
        """The ledger, for reading (never created). Raises `LedgerError` (one line)."""
        if self.url is None:
            return SqliteLedger(ledger_path(self.run_dir), create=False)
        from ettr.errors import UsageError
        from ettr.ledger.url import open_url

        try:
            return open_url(self.url, job_id=self.job_id or self.run_dir.name)
        except UsageError as exc:
            raise LedgerError(str(exc)) from None

    def read(self) -> list[Event]:
        """Every event so far. Raises `LedgerError`."""
        ledger = self.open()
        try:
            return ledger.read()
        finally:
            ledger.close()

    def read_marked(self, *, for_accounting: bool = False) -> tuple[list[Event], LedgerMark]:
        """The events and the mark of the rows they were read from; `for_accounting` leaves out the rows the
        accounting does not use (`ettr.ledger.accounted`). The run directory's own file is opened read-only
        (a reader of many run directories never writes into them). Raises `LedgerError`."""
        if self.url is None:
            own = SqliteLedger(ledger_path(self.run_dir), create=False, read_only=True)
            try:
                return own.read_marked(for_accounting=for_accounting)
            finally:
                own.close()
        from ettr.errors import UsageError
        from ettr.ledger.url import open_url

        try:
            ledger = open_url(self.url, job_id=self.job_id or self.run_dir.name)
        except UsageError as exc:
            raise LedgerError(str(exc)) from None
        try:
            return ledger.read_marked(for_accounting=for_accounting)
        finally:
            ledger.close()

    def mark(self) -> LedgerMark:
        """The mark of the rows the run directory's own ledger holds now. Raises `LedgerError`."""
        if self.url is not None:
            return self.read_marked()[1]
        own = SqliteLedger(ledger_path(self.run_dir), create=False, read_only=True)
        try:
            return own.mark()
        finally:
            own.close()


def locate(run_dir: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> Books:
    """Where the books of `run_dir` are (see the module docstring). Raises `LedgerError` for a directory that
    keeps none."""
    from ettr.run_env import RunEnv

    path = Path(run_dir)
    run_env = RunEnv.from_environ(environ)
    if run_env is not None and run_env.ledger_url and _same_dir(run_env.run_dir, path):
        return Books(path, run_env.ledger_url, run_env.job_id or path.absolute().name)
    problem = unsearchable(path)
    if problem is not None:
        raise LedgerError(problem)
    if os.path.lexists(ledger_path(path)):  # not a regular file: opening it says so (one line)
        return Books(path)
    pointer = read_pointer(path)
    if pointer is not None:
        return Books(path, *pointer)
    if pointer_path(path).exists():
        raise LedgerError(
            f"{path}: its {POINTER_FILENAME} is not readable (a JSON object with url and job_id)"
        )
    raise LedgerError(
        f"{path}: not an ettr run directory (no {LEDGER_FILENAME} or {POINTER_FILENAME} inside)"
        + _runs_inside_hint(path)
    )


def _runs_inside_hint(path: Path, limit: int = 10_000) -> str:
    """A folder of run directories given where one run directory belongs: say how to read them all."""
    try:
        with os.scandir(path) as entries:
            runs = sum(
                1
                for _, entry in zip(range(limit), entries, strict=False)
                if entry.is_dir(follow_symlinks=False) and is_run_dir(entry.path)
            )
    except OSError:
        return ""
    if not runs:
        return ""
    return f"; it holds {runs} run director{'y' if runs == 1 else 'ies'}: give one, or see them all with ettr fleet {path}"


def _same_dir(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False

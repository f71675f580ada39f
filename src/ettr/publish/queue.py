"""The publish queue: a directory of requests that any number of publishers share, safely.

    QUEUE/requests/<id>.json       enqueued, not finished (immutable)
    QUEUE/claims/<id>.json         the lease of the publisher working on it (pid, host, renewed_ts)
    QUEUE/done/<id>.json           finished: where the artifact is and how it verified
    QUEUE/done/<id>.request.json   the request, moved here once done
    QUEUE/failed/<id>.json         given up: why
    QUEUE/failed/<id>.request.json the request, moved here once failed (`requeue` puts it back)

The four directories are the queue's layout: opening the queue (`open_layout`, and each `pending`, claim
and finish) makes the missing ones and refuses one that is a symlink or not a directory (`PublishError`):
anyone who can write the queue could otherwise point `requests/` at another directory and have its files
moved into `failed/`, or `claims/` elsewhere. The root itself may be a symlink (its user named it).

Every file appears whole or not at all (`ettr.atomic`: a temporary name, fsync'd, renamed). A claim is
created with `link(2)`, which fails if the name exists, so exactly one publisher wins it. A publisher
renews its claim while it works; a claim whose owner is dead (same host: its pid is gone or reused) or
whose lease expired (`ttl_s` without renewal) is stale, and the next publisher takes it over with the
attempt count one higher. A takeover renames the stale claim aside and checks it moved the one it judged
stale, so two publishers never both take one over. Claims only avoid duplicate work: that a request yields
one artifact is guaranteed by the artifact's own atomic rename (`ettr.publish.artifact`).

Needs a POSIX filesystem with atomic rename and hard links (local disk, NFS); not an object store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from ettr.atomic import atomic_write, create_exclusive
from ettr.errors import describe_os_error
from ettr.procs import pid_alive, start_ticks
from ettr.publish.request import MAX_REQUEST_BYTES, PublishError, PublishRequest, parse_json
from ettr.untrusted import SymlinkRefused, make_dirs_below, open_regular

logger = logging.getLogger("ettr")

_REQUESTS, _CLAIMS, _DONE, _FAILED = "requests", "claims", "done", "failed"  # the queue's directories
LAYOUT = (_REQUESTS, _CLAIMS, _DONE, _FAILED)
"""The queue's directories, each below its root (never a symlink: `PublishQueue.open_layout`)."""
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
"""What a request id (and so its file name) may be; anything else is moved aside unread."""


class RequestState(StrEnum):
    """Where a request stands in the queue (`PublishQueue.status`)."""

    PENDING = "pending"
    """Enqueued; nobody holds a claim."""
    CLAIMED = "claimed"
    """A publisher holds a claim (live or stale)."""
    DONE = "done"
    """Published: the artifact is committed."""
    FAILED = "failed"
    """Given up, with a reason."""

    @property
    def finished(self) -> bool:
        return self in (RequestState.DONE, RequestState.FAILED)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        body = parse_json(_read_untrusted(path))
    except (OSError, ValueError, RecursionError, PublishError):
        return None
    return body if isinstance(body, dict) else None


MAX_CLAIM_TTL_S = 86400.0
"""The longest lease a claim may hold without renewal (`WorkerConfig.lease_ttl_s` is at most this): a claim
saying more, or renewed further ahead of the reader's clock than its lease, is forged or damaged: stale."""


def _carried_over(previous: dict[str, Any] | None, now: float) -> tuple[int, float]:
    """(attempt, first claimed ts) of a claim taking over `previous` (a garbled one counts as attempt 0)."""
    if previous is None:
        return 0, now
    attempt, first_ts = previous.get("attempt"), previous.get("first_claimed_ts")
    attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt >= 0 else 0
    if isinstance(first_ts, (int, float)) and not isinstance(first_ts, bool) and math.isfinite(first_ts):
        return attempt + 1, float(first_ts)
    return attempt + 1, now


def _read_untrusted(path: Path) -> bytes:
    """A request file's bytes: never through a symlink, never more than the size a request may have."""
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_REQUEST_BYTES + 1)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Claim:
    """A publisher's lease on one request."""

    request_id: str
    token: str
    attempt: int
    """0 for the first claim; one more for each takeover from a dead or expired owner."""
    claimed_ts: float
    first_claimed_ts: float
    """When the request was first claimed by anyone (the publish job's allocation time)."""
    previous: dict[str, Any] | None = None
    """The stale claim this one took over (its owner, attempt, last renewal), if any."""


class PublishQueue:
    """One queue directory. Safe for concurrent publishers on one or several hosts sharing the directory.

    Args:
        root: the queue directory (created by `enqueue`, or `create=True`).
        create: make the directory layout now (`open_layout`: raises PublishError for a symlinked one).
        clock: Unix seconds (tests pass a fake).
        host: this host's name (tests pass another to act as a remote publisher).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        create: bool = False,
        clock: Callable[[], float] = time.time,
        host: str | None = None,
    ) -> None:
        self.root = Path(root)
        self._clock = clock
        self._host = host or socket.gethostname()
        if create:
            self.open_layout()

    def open_layout(self) -> None:
        """Make the queue's directories (`LAYOUT`) that are missing, the root too, and check that each is a
        directory reached without a symlink. Raises PublishError (one line) when one is a symlink or not a
        directory, or cannot be made.

        The check and the later writes by name are two steps: a directory swapped for a symlink between them
        is not seen (each `pending`, claim and finish checks again)."""
        for sub in LAYOUT:
            try:
                make_dirs_below(self.root, self.root / sub)
            except SymlinkRefused as exc:
                raise PublishError(f"publish queue {self.root}: {exc} (make it a directory)") from None
            except OSError as exc:
                raise PublishError(f"publish queue {self.root}: {describe_os_error(exc)}") from None

    def _path(self, sub: str, request_id: str, suffix: str = ".json") -> Path:
        return self.root / sub / f"{request_id}{suffix}"

    # -- producers ---------------------------------------------------------------------------------------
    def enqueue(self, request: PublishRequest) -> bool:
        """Add `request` unless a request with its id is already queued, done or failed (idempotent).

        Returns whether it was added now. Durable on return.
        """
        self.open_layout()
        if self.status(request.request_id) is not None:
            return False
        return create_exclusive(self._path(_REQUESTS, request.request_id), request.to_json())

    # -- reading -----------------------------------------------------------------------------------------
    def status(self, request_id: str) -> RequestState | None:
        """Where the request stands (`RequestState`), or None for an unknown id."""
        if self._path(_DONE, request_id).is_file():
            return RequestState.DONE
        if self._path(_FAILED, request_id).is_file():
            return RequestState.FAILED
        if self._path(_CLAIMS, request_id).is_file():
            return RequestState.CLAIMED
        if self._path(_REQUESTS, request_id).is_file():
            return RequestState.PENDING
        return None

    def pending(self) -> list[str]:
        """Ids of requests not finished (claimed ones included), oldest file first; tidies finished ones.
        [] when the queue's root does not exist; raises PublishError for a symlinked layout (`open_layout`)."""
        if not os.path.lexists(self.root):
            return []
        self.open_layout()
        entries = []
        with contextlib.suppress(FileNotFoundError):
            for path in (self.root / _REQUESTS).glob("*.json"):
                if path.name.startswith("."):
                    continue
                request_id = path.name[: -len(".json")]
                if not _SAFE_ID.match(request_id):
                    self._reject(path)  # not a name a request can have: out of the way, unread
                    continue
                try:
                    mode = path.lstat().st_mode
                except FileNotFoundError:
                    continue
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                    # a FIFO, socket or device: no status, so never claimed and passed over in silence;
                    # never opened (a FIFO blocks). A symlink or directory fails when claimed, as a request.
                    self._reject(path, "not a regular file (a request is one, written by ettr)")
                    continue
                if self._path(_DONE, request_id).is_file() or self._path(_FAILED, request_id).is_file():
                    with contextlib.suppress(OSError):
                        self._archive(request_id)  # a publisher died between finishing and tidying up
                    continue
                with contextlib.suppress(FileNotFoundError):
                    entries.append((path.stat().st_mtime, request_id))
        return [request_id for _, request_id in sorted(entries)]

    def _reject(self, path: Path, why: str = "not a request id: use [A-Za-z0-9_.-], at most 200") -> None:
        """Move a file that can be no request (a name no request id has: too long, odd characters; not a
        regular file) to `failed/.rejected-*`, with a note of its name and `why`; never raises."""
        digest = hashlib.sha1(os.fsencode(path.name)).hexdigest()[:16]
        aside = self.root / _FAILED / f".rejected-{digest}.request.json"
        note = {"name": path.name[:300], "error": why}
        try:
            atomic_write(aside.with_name(f".rejected-{digest}.json"), json.dumps(note).encode())
            os.replace(path, aside)
        except OSError as exc:
            logger.warning("ettr: cannot move aside publish request file %r (%s)", path.name[:80], exc)
            return
        logger.warning("ettr: moved publish request file %r aside: %s", path.name[:80], why)

    def load(self, request_id: str) -> PublishRequest:
        """The request of `request_id` (queued or finished). Raises PublishError if unknown or unreadable."""
        for path in (
            self._path(_REQUESTS, request_id),
            self._path(_DONE, request_id, ".request.json"),
            self._path(_FAILED, request_id, ".request.json"),
        ):
            try:
                data = _read_untrusted(path)
            except FileNotFoundError:
                continue
            except OSError as exc:  # a symlink planted in the queue, a directory, unreadable
                raise PublishError(f"cannot read request file {path.name} ({exc.strerror or exc})") from None
            return PublishRequest.from_json(data)
        raise PublishError(f"no publish request {request_id!r} in {self.root}")

    def failed(self) -> list[str]:
        """Ids of the failed requests whose request is kept in `failed/` (so `requeue` can retry them), oldest
        first. Files moved aside unread (`.rejected-*`) are no requests and are left out."""
        if not os.path.lexists(self.root):
            return []
        self.open_layout()
        entries = []
        with contextlib.suppress(FileNotFoundError):
            for path in (self.root / _FAILED).glob("*.request.json"):
                request_id = path.name[: -len(".request.json")]
                if path.name.startswith(".") or not _SAFE_ID.match(request_id) or not _regular(path):
                    continue  # a symlink or FIFO planted there: no request to retry (it failed again each time)
                if self._path(_FAILED, request_id).is_file():
                    with contextlib.suppress(FileNotFoundError):
                        entries.append((path.stat().st_mtime, request_id))
        return [request_id for _, request_id in sorted(entries)]

    def requeue(self, request_id: str) -> bool:
        """Put a failed request back in `requests/`, so that the next drain publishes it again (its operator
        fixed the cause: a factory not allowed yet, a missing key, a full disk). Returns whether it was
        failed and is pending now. The request goes back before its failure record is removed: a crash
        between the two leaves it failed (`pending` files it back), never lost."""
        self.open_layout()
        kept = self._path(_FAILED, request_id, ".request.json")
        if not self._path(_FAILED, request_id).is_file() or not _regular(kept):
            return False
        os.replace(kept, self._path(_REQUESTS, request_id))
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(_FAILED, request_id))
        return True

    def result(self, request_id: str) -> dict[str, Any] | None:
        """The done or failed record of `request_id` (None while unfinished)."""
        return _read_json(self._path(_DONE, request_id)) or _read_json(self._path(_FAILED, request_id))

    # -- claims ------------------------------------------------------------------------------------------
    def is_stale(self, body: dict[str, Any]) -> bool:
        """Whether a claim's owner is dead (this host) or its lease has expired (any host)."""
        try:
            renewed_ts, ttl_s = float(body["renewed_ts"]), float(body["ttl_s"])
        except (KeyError, TypeError, ValueError, OverflowError):
            return True  # unreadable: nobody can be relying on it
        # The claim's own word bounded: whoever writes the queue can write a claim, and one renewed in
        # the year 3000, or with a ttl of 1e300 or Infinity, held its request (anyone's) for ever.
        ttl_s = min(ttl_s, MAX_CLAIM_TTL_S)
        if not -ttl_s <= self._clock() - renewed_ts <= ttl_s:  # expired, from the future, or NaN
            return True
        pid = body.get("pid")
        if body.get("host") == self._host and isinstance(pid, int):
            return not pid_alive(pid, body.get("pid_start_ticks"))
        return False

    def try_claim(self, request_id: str, *, ttl_s: float) -> Claim | None:
        """Claim `request_id` for this process, taking over a stale claim; None if it is finished, unknown,
        or held by a live publisher."""
        self.open_layout()
        if self.status(request_id) not in ("pending", "claimed"):
            return None
        path = self._path(_CLAIMS, request_id)
        previous = None
        current = _read_json(path)
        if current is not None or path.exists():
            if current is not None and not self.is_stale(current):
                return None
            if not self._take_aside(path, current):
                return None
            previous = current
        now = self._clock()
        token = uuid.uuid4().hex
        attempt, first_ts = _carried_over(previous, now)
        body = {
            "request_id": request_id,
            "token": token,
            "attempt": attempt,
            "pid": os.getpid(),
            "pid_start_ticks": start_ticks(os.getpid()),
            "host": self._host,
            "claimed_ts": now,
            "first_claimed_ts": first_ts,
            "renewed_ts": now,
            "ttl_s": ttl_s,
        }
        if not create_exclusive(path, json.dumps(body).encode()):
            return None  # another publisher claimed it between our look and our create
        state = self.status(request_id)
        if state is not None and state.finished:  # finished while we looked: nothing to do
            self.release(Claim(request_id, token, attempt, now, first_ts))
            return None
        summary = None
        if previous:
            summary = {k: previous.get(k) for k in ("attempt", "pid", "host", "claimed_ts", "renewed_ts")}
        return Claim(request_id, token, attempt, now, first_ts, summary)

    def _take_aside(self, path: Path, seen: dict[str, Any] | None) -> bool:
        """Move the stale claim `seen` out of the way; False if another publisher got there first."""
        aside = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return seen is None  # it vanished: free to create only if we never saw a live body
        moved = _read_json(aside)
        if seen is not None and (moved is None or moved.get("token") != seen.get("token")):
            # We moved a fresh claim someone made after our look: put it back and stand aside.
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
            with contextlib.suppress(OSError):
                os.remove(aside)
            return False
        with contextlib.suppress(OSError):
            os.remove(aside)
        return True

    def owns(self, claim: Claim) -> bool:
        """Whether `claim` is still the request's current claim (nobody took it over)."""
        body = _read_json(self._path(_CLAIMS, claim.request_id))
        return body is not None and body.get("token") == claim.token

    def renew(self, claim: Claim) -> bool:
        """Extend the lease (call well within `ttl_s`); False if the claim was lost to another publisher."""
        path = self._path(_CLAIMS, claim.request_id)
        body = _read_json(path)
        if body is None or body.get("token") != claim.token:
            return False
        body["renewed_ts"] = self._clock()
        atomic_write(path, json.dumps(body).encode())
        return True

    def release(self, claim: Claim) -> None:
        """Give up a claim without finishing (another publisher may claim the request afresh)."""
        if self.owns(claim):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(_CLAIMS, claim.request_id))

    # -- finishing ---------------------------------------------------------------------------------------
    def complete(self, claim: Claim, record: dict[str, Any]) -> None:
        """Record the request as done (`record`: where the artifact is, its verification); durable."""
        self._finish(_DONE, claim.request_id, {**record, "attempt": claim.attempt})

    def fail(self, claim: Claim, error: str, record: dict[str, Any] | None = None) -> None:
        """Record the request as failed with `error` (it is not retried); durable."""
        self._finish(_FAILED, claim.request_id, {**(record or {}), "error": error, "attempt": claim.attempt})

    def _finish(self, sub: str, request_id: str, record: dict[str, Any]) -> None:
        self.open_layout()
        body = {"request_id": request_id, "finished_ts": self._clock(), **record}
        atomic_write(self._path(sub, request_id), json.dumps(body, indent=1, default=str).encode())
        self._archive(request_id)

    def _archive(self, request_id: str) -> None:
        """Move a finished request out of `requests/` and drop its claim (idempotent)."""
        if self._path(_DONE, request_id).is_file():
            with contextlib.suppress(FileNotFoundError):
                os.replace(self._path(_REQUESTS, request_id), self._path(_DONE, request_id, ".request.json"))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.replace(
                    self._path(_REQUESTS, request_id), self._path(_FAILED, request_id, ".request.json")
                )
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(_CLAIMS, request_id))


def _regular(path: Path) -> bool:
    """Whether `path` itself (not what a symlink points at) is a regular file."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False

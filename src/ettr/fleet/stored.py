"""A finished job's summary, stored once by its writer next to its events and read back by the fleet.

At a job's end its supervisor (`ettr run`) accounts the job once and stores its `JobSummary` together with
the mark of the events it was computed from (`LedgerMark`: how many rows, and the last row's id, both
taken from the very read the summary was computed from): in the run directory as `fleet-summary.json`
(written commit-last), or in a shared PostgreSQL ledger's `ettr.summaries` table. `ettr fleet` and
`ettr serve` use a stored summary only while the ledger still holds exactly those rows (same count, same
last id) and it was written by the same accounting (`CACHE_VERSION` and the ettr version); otherwise they
read the events. A requeued job (a new supervisor start), a spill delivered late, a rebuilt ledger or a
newer ettr: the summary is stale and is recomputed from the events, never trusted.

A run directory's summary is signed with its writer's key (the user's key ring, `ettr.keyring`: the key
checkpoints are signed with) and used only when a key of the reader's ring verifies it, and every stored
summary is validated (`ettr.fleet.model.check_summary`: finite, in range, buckets that add up). Anyone who can
write a run directory can write its summary: one that is forged, damaged or NaN, or signed by another user's
key, is not used: the job is accounted from its events instead, and a summary that is malformed or whose
signature fails under the reader's own key is renamed `fleet-summary.json.rejected` (once) and named in one
line. A PostgreSQL ledger's summaries are validated only: its table is guarded as its events are.

Only a finished job is stored: a JOB_END after its last supervisor start, and not a preempted one (its
supervisor skips the hook: a requeue would make the summary stale at once, and it delayed the requeue). Its summary is then a function
of its events alone (the report is closed at its last event, as `ettr report` closes it), so it equals
what the fleet would compute from the events. A running job's figures move with the clock: never stored.
Storing never raises (telemetry never hurts training): a failure is logged and the fleet reads the events.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ettr.fleet.model import JobSummary, summary_from_json, summary_to_json, version
from ettr.ledger.base import LedgerError, LedgerMark
from ettr.untrusted import loads_bounded, read_small_file
from ettr.warn import WarnOnce

logger = logging.getLogger("ettr")

SUMMARY_FILENAME = "fleet-summary.json"
"""The stored summary of a finished job in its run directory."""

REJECTED_SUFFIX = ".rejected"
"""A summary that failed its checks is renamed to this (beside it) so it is named once, not at every read."""

FORMAT = "ettr.fleet-summary/1"

MAX_SUMMARY_BYTES = 1 << 20
"""No summary ettr writes is near this (a few KB, more with many failures): a larger file is not one."""

_warn = WarnOnce("ettr: {what}")


def summary_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / SUMMARY_FILENAME


def _key(mark: LedgerMark) -> list[Any]:
    from ettr.fleet.load import CACHE_VERSION

    return [FORMAT, CACHE_VERSION, version(), mark.num_rows, mark.last_id]


def encode(
    summary: JobSummary,
    mark: LedgerMark,
    *,
    job_id_recorded: bool,
    files: list[int] | None = None,
    sign: bool = False,
) -> str:
    """The stored form of `summary`, computed from the rows `mark` describes; `files` is the ledger files'
    identity, size and time while they held exactly those rows (`file_signature`), if known; with `sign`,
    signed with the user's key ring's signing key (when there is one)."""
    payload: dict[str, Any] = {
        "key": _key(mark),
        "job_id_recorded": job_id_recorded,
        "files": files,
        "summary": summary_to_json(summary),
    }
    if sign:
        ring = _ring(create=True)
        if ring is not None and ring.signing is not None:
            payload["signature"] = {
                "key_id": ring.signing_id,
                "hmac": ring.mac(ring.signing, _canonical(payload)),
            }
    return json.dumps(payload, allow_nan=False, separators=(",", ":"))


def _canonical(payload: Mapping[str, Any]) -> bytes:
    """The bytes a summary's signature covers: everything in it but the signature."""
    body = {k: v for k, v in payload.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _ring(*, create: bool) -> Any:
    """The user's key ring (`ettr.keyring.KeyRing`), or None when it cannot be had; for reading (`create`
    False), kept while its directory is unchanged (a fleet verifies thousands of summaries)."""
    try:
        from ettr.keyring import KeyRing, key_dir

        if create:
            return KeyRing.open(create=True)
        directory = key_dir()
        try:
            st = os.stat(directory)
            stamp = (str(directory), st.st_ino, st.st_mtime_ns, os.environ.get("ETTR_CHECKPOINT_SECRET", ""))
        except OSError:
            stamp = (str(directory), 0, 0, os.environ.get("ETTR_CHECKPOINT_SECRET", ""))
        if _READ_RING.get("stamp") != stamp:
            _READ_RING["stamp"], _READ_RING["ring"] = stamp, KeyRing.open(create=False)
        return _READ_RING["ring"]
    except Exception as exc:  # noqa: BLE001 - no ring: nothing is signed, every summary is recomputed
        logger.debug("ettr: no key ring for fleet summaries (%s)", exc)
        return None


_READ_RING: dict[str, Any] = {}


class Untrusted(ValueError):
    """A stored summary that is malformed, out of range, or whose signature fails under a key the reader
    holds: quarantined and named."""


def _verified(data: Mapping[str, Any], ring: Any) -> bool:
    """Whether `data` carries a signature a key of `ring` verifies. Raises `Untrusted` when it names a key
    of the ring and does not verify (forged or damaged); False when unsigned or signed by a key the
    reader does not hold (another user's job: its events are read)."""
    signature = data.get("signature")
    if ring is None or not isinstance(signature, Mapping):
        return False
    key = ring.keys.get(signature.get("key_id")) if isinstance(signature.get("key_id"), str) else None
    if key is None:
        return False
    mac = signature.get("hmac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, ring.mac(key, _canonical(data))):
        raise Untrusted("its signature does not verify (forged or damaged)")
    return True


def file_signature(run_dir: Path) -> list[int]:
    """What changes when a run directory's ledger changes: the database file's device and inode (a rebuilt
    ledger is a new file) and its and its write-ahead log's size and modification time."""
    from ettr.fleet.load import _ledger_signature
    from ettr.ledger import ledger_path

    st = os.stat(ledger_path(run_dir))
    return [st.st_dev, st.st_ino, *_ledger_signature(run_dir)]


def decode(
    text: str | bytes | Mapping[str, Any],
    mark: LedgerMark,
    *,
    source: str,
    run_dir: Path | None = None,
    ring: Any = None,
) -> JobSummary | None:
    """The stored summary in `text` if it was computed from exactly the rows `mark` describes now (by this
    accounting), with `source` as the fleet names it; None when stale or from another ettr; with `ring`, None
    also unless a key of `ring` verifies its signature. Raises `Untrusted` when it is malformed or forged."""
    data = _parsed(text)
    if data.get("key") != _key(mark):
        return None
    if ring is not None and not _verified(data, ring):
        return None
    summary = _summary_of(data)
    if summary.running or summary.in_progress:
        return None
    job_id = summary.job_id
    if run_dir is not None and not data.get("job_id_recorded", True):
        job_id = run_dir.absolute().name  # named after its directory, as `ettr report` names it
    name = run_dir.absolute().name if run_dir is not None else summary.name  # the directory it is read in
    return replace(summary, source=source, job_id=job_id, name=name)


def _parsed(text: str | bytes | Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        data = text if isinstance(text, Mapping) else loads_bounded(text)
    except ValueError as exc:
        raise Untrusted(f"not JSON ettr writes ({exc})") from None
    if not isinstance(data, Mapping):
        raise Untrusted("not a JSON object")
    return data


def _summary_of(data: Mapping[str, Any]) -> JobSummary:
    try:
        return summary_from_json(data["summary"])
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise Untrusted(f"not a summary this ettr writes ({str(exc)[:120] or type(exc).__name__})") from None


def summarize_finished(events: Any, *, job_id: str, source: str) -> JobSummary | None:
    """The summary of a finished job's events (see the module docstring), or None when it is not finished."""
    from ettr.fleet.load import _scan, summarize_events

    if not events or _scan(events).open_start is not None:
        return None
    summary = summarize_events(events, job_id=job_id, source=source, now=0.0)
    return None if summary.running or summary.in_progress else summary


def store_run_dir(run_dir: str | os.PathLike[str]) -> JobSummary | None:
    """Account the finished job of `run_dir` once and store its summary there (commit-last). Returns it, or
    None when the job is not finished. Raises `LedgerError` / OSError."""
    from ettr.atomic import atomic_write
    from ettr.closing import recorded_job_id
    from ettr.ledger import Books

    path = Path(run_dir)
    before = file_signature(path)
    # Every row, not only the reference rank's steps: the other ranks' steps tell its slow ranks.
    events, mark = Books(path).read_marked()
    files = before if file_signature(path) == before else None  # nothing appended while reading
    recorded = recorded_job_id(events)
    summary = summarize_finished(events, job_id=recorded or path.absolute().name, source=str(path))
    if summary is None:
        return None
    text = encode(summary, mark, job_id_recorded=recorded is not None, files=files, sign=True)
    atomic_write(summary_path(path), text)
    return summary


def store_url(url: str, job_id: str) -> JobSummary | None:
    """Account the finished job `job_id` of the PostgreSQL ledger at `url` once and store its summary in the
    ledger. Returns it, or None when the job is not finished. Raises `LedgerError`."""
    from ettr.ledger.postgres import PostgresLedger, redact

    ledger = PostgresLedger(url, job_id=job_id)
    try:
        events, mark = ledger.read_marked()  # every rank's steps: they tell its slow ranks
        # stored where every reader of the ledger sees it: the URL without its password (it was kept whole)
        summary = summarize_finished(events, job_id=job_id, source=redact(url))
        if summary is not None:
            ledger.store_summary(mark, encode(summary, mark, job_id_recorded=True))
    finally:
        ledger.close()
    return summary


def store_at_job_end(run_dir: str | os.PathLike[str], *, ledger_url: str | None, job_id: str | None) -> None:
    """The supervisor's one call at job end, after its books are closed: store the job's summary where its
    events are (a PostgreSQL ledger URL, else the run directory). Never raises; a failure only means the
    fleet reads this job's events."""
    try:
        if not ledger_url:
            store_run_dir(run_dir)
        elif job_id:
            from ettr.ledger.url import scheme_of

            if scheme_of(ledger_url) == "postgresql":
                store_url(ledger_url, job_id)
    except Exception as exc:  # noqa: BLE001 - telemetry never hurts the job
        logger.info("ettr: the job's fleet summary was not stored (%s); the fleet reads its events", exc)


def load_stored(run_dir: Path) -> JobSummary | None:
    """The stored summary of `run_dir` if a key of this user's ring verifies it and its ledger still holds
    exactly the rows it was computed from: when the ledger files are the very ones, unchanged in size and
    time, that held those rows at the store, without opening the database; else by counting its rows now.
    None otherwise (the fleet reads the events); a malformed or forged summary is also quarantined."""
    from ettr.ledger import Books

    path = summary_path(run_dir)
    try:
        raw = read_small_file(path, MAX_SUMMARY_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _reject(path, f"cannot be read ({exc.strerror or exc})")
        return None
    try:
        data = _parsed(raw)
        ring = _ring(create=False)
        if not _verified(data, ring):
            return None
        key: Any = data.get("key")
        mark = None
        if data.get("files") is not None and data["files"] == file_signature(run_dir):
            mark = LedgerMark(int(key[3]), int(key[4]))
        if mark is None:
            try:
                mark = Books(run_dir).mark()
            except (LedgerError, OSError):
                return None
        return decode(data, mark, source=str(run_dir), run_dir=run_dir)
    except Untrusted as exc:
        _reject(path, str(exc))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        _reject(path, f"not a summary this ettr writes ({exc})")
    return None


def _reject(path: Path, why: str) -> None:
    """Say once that the summary at `path` is not used, and rename it aside (when the directory may be
    written: the next read then does not meet it again)."""
    moved = ""
    try:
        if os.path.lexists(path):
            os.replace(path, path.with_name(path.name + REJECTED_SUFFIX))
            moved = f"; renamed to {path.name}{REJECTED_SUFFIX}"
    except OSError:
        pass
    _warn(f"{path}: {why}; not used, the job is accounted from its events{moved}")

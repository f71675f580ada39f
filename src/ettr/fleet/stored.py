"""A finished job's summary, stored once by its writer next to its events and read back by the fleet.

At a job's end its supervisor (`ettr run`) accounts the job once and stores its `JobSummary` together with
the mark of the events it was computed from (`LedgerMark`: how many rows, and the last row's id, both
taken from the very read the summary was computed from): in the run directory as `fleet-summary.json`
(written commit-last), or in a shared PostgreSQL ledger's `ettr.summaries` table. `ettr fleet` and
`ettr serve` use a stored summary only while the ledger still holds exactly those rows (same count, same
last id) and it was written by the same accounting (`CACHE_VERSION` and the ettr version); otherwise they
read the events. A requeued job (a new supervisor start), a spill delivered late, a rebuilt ledger or a
newer ettr: the summary is stale and is recomputed from the events, never trusted.

Only a finished job is stored: a JOB_END after its last supervisor start. Its summary is then a function
of its events alone (the report is closed at its last event, as `ettr report` closes it), so it equals
what the fleet would compute from the events. A running job's figures move with the clock: never stored.
Storing never raises (telemetry never hurts training): a failure is logged and the fleet reads the events.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ettr.fleet.model import JobSummary, summary_from_json, summary_to_json, version
from ettr.ledger.base import LedgerError, LedgerMark

logger = logging.getLogger("ettr")

SUMMARY_FILENAME = "fleet-summary.json"
"""The stored summary of a finished job in its run directory."""

FORMAT = "ettr.fleet-summary/1"


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
) -> str:
    """The stored form of `summary`, computed from the rows `mark` describes; `files` is the ledger files'
    identity, size and time while they held exactly those rows (`file_signature`), if known."""
    payload = {
        "key": _key(mark),
        "job_id_recorded": job_id_recorded,
        "files": files,
        "summary": summary_to_json(summary),
    }
    return json.dumps(payload, allow_nan=True, separators=(",", ":"))


def file_signature(run_dir: Path) -> list[int]:
    """What changes when a run directory's ledger changes: the database file's device and inode (a rebuilt
    ledger is a new file) and its and its write-ahead log's size and modification time."""
    from ettr.fleet.load import _ledger_signature
    from ettr.ledger import ledger_path

    st = os.stat(ledger_path(run_dir))
    return [st.st_dev, st.st_ino, *_ledger_signature(run_dir)]


def decode(
    text: str | bytes | Mapping[str, Any], mark: LedgerMark, *, source: str, run_dir: Path | None = None
) -> JobSummary | None:
    """The stored summary in `text` if it was computed from exactly the rows `mark` describes now (by this
    accounting), with `source` as the fleet names it; None when stale, from another ettr, or malformed."""
    try:
        data = text if isinstance(text, Mapping) else json.loads(text)
        if not isinstance(data, Mapping) or data.get("key") != _key(mark):
            return None
        summary = summary_from_json(data["summary"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if summary.running or summary.in_progress:
        return None
    job_id = summary.job_id
    if run_dir is not None and not data.get("job_id_recorded", True):
        job_id = run_dir.absolute().name  # named after its directory, as `ettr report` names it
    name = run_dir.absolute().name if run_dir is not None else summary.name  # the directory it is read in
    return replace(summary, source=source, job_id=job_id, name=name)


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
    text = encode(summary, mark, job_id_recorded=recorded is not None, files=files)
    atomic_write(summary_path(path), text)
    return summary


def store_url(url: str, job_id: str) -> JobSummary | None:
    """Account the finished job `job_id` of the PostgreSQL ledger at `url` once and store its summary in the
    ledger. Returns it, or None when the job is not finished. Raises `LedgerError`."""
    from ettr.ledger.postgres import PostgresLedger

    ledger = PostgresLedger(url, job_id=job_id)
    try:
        events, mark = ledger.read_marked()  # every rank's steps: they tell its slow ranks
        summary = summarize_finished(events, job_id=job_id, source=url)
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
    """The stored summary of `run_dir` if its ledger still holds exactly the rows it was computed from:
    when the ledger files are the very ones, unchanged in size and time, that held those rows at the
    store, without opening the database; else by counting its rows now."""
    from ettr.ledger import Books

    try:
        data = json.loads(summary_path(run_dir).read_bytes())
        key = data["key"]
        mark = None
        if data.get("files") is not None and data["files"] == file_signature(run_dir):
            mark = LedgerMark(int(key[3]), int(key[4]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    if mark is None:
        try:
            mark = Books(run_dir).mark()
        except (LedgerError, OSError):
            return None
    return decode(data, mark, source=str(run_dir), run_dir=run_dir)

"""The publisher: claims requests from a queue, builds their artifacts, and keeps each one's books.

`ettr publish QUEUE_DIR` runs `PublishWorker.drain` (every request that is pending now, then exit: by hand,
or by whatever runs after the training job) or, with `--watch`, `PublishWorker.watch` (a long-running
worker polling the directory). Any number of workers may share a queue. Per request:

    claim (or take over a dead publisher's claim; give up after `max_attempts` tries)
    -> books: SUPERVISOR_START / ATTEMPT_START in the request's run directory
    -> build_artifact: load, export, verify, write, commit — each a recorded phase; the claim is renewed
       by a heartbeat thread meanwhile, and checked before the commit
    -> done (or failed) record in the queue; ATTEMPT_END and JOB_END in the books.

A publisher killed anywhere leaves a claim whose owner is dead: the next worker takes it over and retries.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from ettr.publish.artifact import LostClaim, build_artifact
from ettr.publish.books import PublishBooks
from ettr.publish.policy import PublishPolicy
from ettr.publish.queue import MAX_CLAIM_TTL_S, Claim, PublishQueue
from ettr.publish.request import PublishError
from ettr.untrusted import printable

logger = logging.getLogger("ettr")

FAULT_POINTS = ("claimed", "load", "export", "verify", "write", "commit", "committed")
"""Where a worker's `fault_hook` is called, in order (tests kill the publisher there)."""


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How a publisher shares the queue with others."""

    lease_ttl_s: float = 120.0
    """A claim not renewed for this long is taken over by another publisher (on the owner's own host a
    dead owner's claim is taken over at once). Renewed every quarter of it while a build runs."""
    max_attempts: int = 3
    """Tries per request, counting those whose publisher died; after that the request is failed."""
    poll_interval_s: float = 2.0
    """How often `watch` looks for new requests."""

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "poll_interval_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.lease_ttl_s > MAX_CLAIM_TTL_S:  # other publishers take a longer one for forged
            raise ValueError(f"lease_ttl_s must be at most {MAX_CLAIM_TTL_S:.0f} s, got {self.lease_ttl_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


class PublishStatus(StrEnum):
    """What happened to one request a worker claimed."""

    PUBLISHED = "published"
    """Built now."""
    EXISTING = "existing"
    """The artifact was already there (a parallel build committed first)."""
    FAILED = "failed"
    """This request is given up (the queue says why)."""
    LOST = "lost"
    """Taken over by another publisher mid-build; that one finishes it."""


@dataclass(frozen=True, kw_only=True)
class PublishOutcome:
    """What happened to one request this worker claimed."""

    request_id: str
    status: PublishStatus
    attempt: int
    artifact_dir: str | None = None
    run_dir: str | None = None
    error: str | None = None
    verification: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is not PublishStatus.FAILED

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "status": self.status,
            "attempt": self.attempt,
            "artifact_dir": self.artifact_dir,
            "run_dir": self.run_dir,
            "error": self.error,
            "verification": self.verification,
        }


class _Heartbeat:
    """Renews a claim every `interval_s` until stopped; `lost` is set if the claim was taken over."""

    def __init__(self, queue: PublishQueue, claim: Claim, interval_s: float) -> None:
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._queue, self._claim, self._interval_s = queue, claim, interval_s
        self._thread = threading.Thread(target=self._run, name="ettr-publish-lease", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                if not self._queue.renew(self._claim):
                    self.lost.set()
                    return
            except OSError as exc:  # a flaky shared filesystem: try again at the next beat
                logger.warning("ettr: cannot renew the claim on %s (%s)", self._claim.request_id, exc)


class PublishWorker:
    """Publishes the requests of one queue directory.

    Args:
        queue_dir: the queue (`PublishConfig.queue_dir` of the training job).
        config: lease, retry and polling settings.
        policy: which model code and paths a request may name (`PublishPolicy.for_queue`); a request
            outside it is failed before anything of it is imported or written.
        fault_hook: tests only: called with each of `FAULT_POINTS` as the build reaches it.
        command: how this worker was started (recorded in the publish jobs' books).
    """

    def __init__(
        self,
        queue_dir: str | Path,
        config: WorkerConfig | None = None,
        *,
        policy: PublishPolicy,
        fault_hook: Callable[[str], None] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.queue = PublishQueue(queue_dir)
        self.config = config or WorkerConfig()
        self.policy = policy
        self._fault = fault_hook or (lambda point: None)
        self._command = command if command is not None else list(sys.argv)

    def process(self, request_id: str) -> PublishOutcome | None:
        """Claim and publish one request; None if it is finished, unknown, or another publisher holds it."""
        claim = self.queue.try_claim(request_id, ttl_s=self.config.lease_ttl_s)
        if claim is None:
            return None
        try:
            request = self.queue.load(request_id)
            self.policy.check(request, file_id=request_id)
        except PublishError as exc:  # malformed or outside the policy: failed, moved aside, never retried
            logger.warning("ettr: refusing publish request %s: %s", request_id, printable(str(exc)))
            self.queue.fail(claim, str(exc))
            return PublishOutcome(
                request_id=request_id, status=PublishStatus.FAILED, attempt=claim.attempt, error=str(exc)
            )
        books = PublishBooks(request, command=self._command)
        try:
            if claim.attempt >= self.config.max_attempts:
                reason = f"given up: its publisher died or stalled {claim.attempt} times"
                books.close_abandoned(reason)
                self.queue.fail(claim, reason, {"run_dir": request.run_dir})
                return PublishOutcome(
                    request_id=request_id,
                    status=PublishStatus.FAILED,
                    attempt=claim.attempt,
                    run_dir=request.run_dir,
                    error=reason,
                )
            books.begin(claim)
            self._fault("claimed")
            return self._build(claim, request, books)
        finally:
            books.close()

    def _build(self, claim: Claim, request: Any, books: PublishBooks) -> PublishOutcome:
        @contextlib.contextmanager
        def stage(name: str) -> Iterator[None]:
            with books.stage(name):
                self._fault(name)
                yield

        heartbeat = _Heartbeat(self.queue, claim, self.config.lease_ttl_s / 4)
        with heartbeat:
            try:
                result = build_artifact(
                    request,
                    stage=stage,
                    check_resolved=self.policy.check_resolved,
                    allow_unsigned=self.policy.allow_unsigned,
                    still_owner=lambda: not heartbeat.lost.is_set() and self.queue.owns(claim),
                )
            except LostClaim as exc:
                books.end(ok=False, reason=str(exc), final=False)
                return PublishOutcome(
                    request_id=request.request_id,
                    status=PublishStatus.LOST,
                    attempt=claim.attempt,
                    run_dir=request.run_dir,
                )
            except Exception as exc:  # noqa: BLE001 - any failure of a build ends this request, with its reason
                reason = str(exc) if isinstance(exc, PublishError) else f"{type(exc).__name__}: {exc}"
                logger.warning("ettr: publishing %s failed: %s", request.request_id, printable(reason))
                books.end(ok=False, reason=reason[:1000])
                if self.queue.owns(claim):
                    self.queue.fail(claim, reason, {"run_dir": request.run_dir})
                return PublishOutcome(
                    request_id=request.request_id,
                    status=PublishStatus.FAILED,
                    attempt=claim.attempt,
                    run_dir=request.run_dir,
                    error=reason,
                )
        self._fault("committed")
        verification = result.manifest.get("verification", {})
        self.queue.complete(
            claim,
            {
                "artifact_dir": result.path,
                "created": result.created,
                "run_dir": request.run_dir,
                "publish_job_id": request.publish_job_id,
                "verification": verification,
            },
        )
        books.end(ok=True, artifact_dir=result.path)
        return PublishOutcome(
            request_id=request.request_id,
            status=PublishStatus.PUBLISHED if result.created else PublishStatus.EXISTING,
            attempt=claim.attempt,
            artifact_dir=result.path,
            run_dir=request.run_dir,
            verification=verification,
        )

    def drain(self, *, only: str | None = None, max_requests: int | None = None) -> list[PublishOutcome]:
        """Publish every request pending now (or only `only`) that no live publisher holds; then return."""
        outcomes: list[PublishOutcome] = []
        for request_id in self.queue.pending():
            if only is not None and request_id != only:
                continue
            if max_requests is not None and len(outcomes) >= max_requests:
                break
            outcome = self._process_contained(request_id)
            if outcome is not None:
                outcomes.append(outcome)
        return outcomes

    def _process_contained(self, request_id: str) -> PublishOutcome | None:
        """`process`, but a failure of one request (even of the queue's own files) never stops the others."""
        try:
            return self.process(request_id)
        except Exception as exc:  # noqa: BLE001 - one bad request must not block the ones queued after it
            reason = f"{type(exc).__name__}: {str(exc)[:500]}"
            logger.warning("ettr: publish request %s could not be handled: %s", request_id, printable(reason))
            return PublishOutcome(
                request_id=request_id, status=PublishStatus.FAILED, attempt=-1, error=reason
            )

    def watch(
        self,
        stop: threading.Event,
        *,
        max_requests: int | None = None,
        on_outcome: Callable[[PublishOutcome], None] | None = None,
    ) -> list[PublishOutcome]:
        """Publish requests as they arrive until `stop` is set (or `max_requests` are done)."""
        outcomes: list[PublishOutcome] = []
        while not stop.is_set():
            left = None if max_requests is None else max_requests - len(outcomes)
            for outcome in self.drain(max_requests=left):
                outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(outcome)
            if max_requests is not None and len(outcomes) >= max_requests:
                break
            stop.wait(self.config.poll_interval_s)
        return outcomes

"""`ettr serve`: a Prometheus `/metrics` endpoint over run directories or a shared ledger.

Each scrape re-reads the fleet; finished jobs whose ledger did not change come from a cache, so a scrape
costs about the running jobs' events. It listens on 127.0.0.1 unless an address is given, and a client can
hold it only so long: at most `MAX_CONNECTIONS` requests are served at once, each connection gets
`READ_TIMEOUT_S` per read and `REQUEST_DEADLINE_S` in all (a slowloris or an HTTP/0.9 client that never ends
its request line is cut off), and the listen backlog is bounded. When every slot is taken, a new connection
takes the slot of the oldest one whose request head is still arriving (cut), else of the one writing its response
longest, past `WRITE_GRACE_S` (a slow reader: cut), and only when there is none is it closed at once: slow clients
cannot keep a scrape out by holding every slot.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from ettr.errors import UsageError
from ettr.fleet.model import JobSummary

logger = logging.getLogger("ettr")

DEFAULT_ADDR = "127.0.0.1"
"""Where `ettr serve` listens unless `--addr` says otherwise (the contract: never every interface by default)."""
MAX_CONNECTIONS = 16
"""Requests served at once; a connection beyond them takes the slot of the oldest connection still sending its
request head, else it is closed at once (Prometheus retries the next scrape)."""
SLOT_WAIT_S = 5.0
"""How long a new connection waits for the slot of the slow connection it cut (its thread ends at once)."""
BACKLOG = 32
"""Connections the kernel queues before they are accepted."""
READ_TIMEOUT_S = 10.0
"""The longest one read of a request may wait for its client (and one write of its response: the socket's
timeout)."""
WRITE_GRACE_S = 2.0
"""How long a connection may write its response before its slot may be taken by a new connection when every
slot is taken: a scrape reads its response at once (7.6 MB in 0.5 s here), a slow reader (a byte a second)
held its slot for the socket's timeout, again at each reconnection, and scrapes were closed unanswered."""
REQUEST_DEADLINE_S = 120.0
"""The longest a connection is kept, reading, loading and writing (a scrape of a large fleet takes seconds)."""
SCRAPE_BUDGET_S = 4.0
"""How long a scrape of `ettr serve` waits for its read of the fleet: inside Prometheus' default scrape timeout
(10 s) and a 5 s one. A read that takes longer (a ledger server stalled: each costs its connect timeout; a
PostgreSQL server under SIGSTOP made scrapes take 3.0-5.8 s, and a scrape past the timeout drops every series of
the target) goes on in the background, and the scrape serves the newest complete read (`BoundedReads`)."""


class _QuietHandler(WSGIRequestHandler):
    """Logs nothing per request; every read waits at most `READ_TIMEOUT_S` (`StreamRequestHandler.timeout`).
    Tells the server when the request head has arrived, and answers nothing to a connection cut meanwhile."""

    timeout = READ_TIMEOUT_S
    server: BoundedServer

    def parse_request(self) -> bool:
        return super().parse_request() and self.server.head_arrived(self.request)

    def setup(self) -> None:
        super().setup()
        self.wfile = _Writing(self.wfile, lambda: self.server.writing(self.request))  # type: ignore[assignment]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A WSGI server with a thread per request, at most `MAX_CONNECTIONS` of them, each connection closed
    after `REQUEST_DEADLINE_S` whatever its client does."""

    daemon_threads = True
    request_queue_size = BACKLOG
    allow_reuse_address = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._heads: dict[socket.socket, None] = {}
        """Connections whose request head has not all arrived, oldest first."""
        self._cut_heads: set[socket.socket] = set()
        self._writers: dict[socket.socket, float] = {}
        """Connections writing their response, and since when (monotonic), oldest first."""
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not self._take_a_slow_slot():
            self.shutdown_request(request)  # busy with whole requests: refused at once, never queued
            return
        with self._lock:
            self._heads[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            self._slots.release()
            raise

    def _take_a_slow_slot(self) -> bool:
        """Cut the oldest connection still sending its request head (16 slowloris clients held every slot,
        and every scrape was refused while they did) and take its slot once its thread ends."""
        with self._lock:
            oldest = next(iter(self._heads), None)
            if oldest is not None:
                del self._heads[oldest]
                self._cut_heads.add(oldest)
            else:  # else a slow reader: the oldest connection writing its response for over WRITE_GRACE_S
                slow = next(iter(self._writers.items()), None)
                if slow is None or time.monotonic() - slow[1] < WRITE_GRACE_S:
                    return False
                oldest = slow[0]
                del self._writers[oldest]
        _cut(oldest)
        return self._slots.acquire(timeout=SLOT_WAIT_S)

    def writing(self, request: socket.socket) -> None:
        """`request`'s response began to be written (its slot may be given up for a new connection after
        WRITE_GRACE_S)."""
        with self._lock:
            self._writers.setdefault(request, time.monotonic())

    def head_arrived(self, request: socket.socket) -> bool:
        """The request head of `request` was read: its connection is no longer given up for a new one.
        False when it was cut for one meanwhile (then nothing is answered)."""
        with self._lock:
            self._heads.pop(request, None)
            return request not in self._cut_heads

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            self._heads.pop(request, None)
            self._cut_heads.discard(request)
            self._writers.pop(request, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        deadline = threading.Timer(REQUEST_DEADLINE_S, _cut, (request,))
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._forget(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("ettr serve: a request from %s failed", client_address, exc_info=True)


class _Writing:
    """A handler's `wfile` that tells `on_first` when the response begins to be written."""

    def __init__(self, raw: Any, on_first: Callable[[], None]) -> None:
        self._raw = raw
        self._on_first: Callable[[], None] | None = on_first

    def write(self, data: Any) -> Any:
        if self._on_first is not None:
            on_first, self._on_first = self._on_first, None
            on_first()
        return self._raw.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _cut(request: socket.socket) -> None:
    """End a connection that outlived its deadline (its thread's blocked read or write then returns)."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


@dataclass
class MetricsServer:
    """A running /metrics server; `close()` stops it."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5.0)


def start_server(
    load: Callable[[float], tuple[list[JobSummary], list[str]]], *, port: int, addr: str = DEFAULT_ADDR
) -> MetricsServer:
    """Serve the metrics of `load(now)` at http://addr:port/metrics (port 0: any free port)."""
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
    except ImportError:
        raise UsageError(
            "ettr serve: needs prometheus-client (install it: pip install 'prometheus-client>=0.17')"
        ) from None

    from ettr.fleet.metrics import FleetCollector

    registry = CollectorRegistry(auto_describe=False)
    age = (lambda: load.served_age_s) if isinstance(load, BoundedReads) else None
    registry.register(FleetCollector(load, read_age_s=age))
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]

        class Server(BoundedServer):
            address_family = family

        httpd = Server((sockaddr[0], port), _QuietHandler)
    except (OSError, UnicodeError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise UsageError(f"ettr serve: cannot listen on {addr}:{port} ({why})") from None
    httpd.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=httpd.serve_forever, name="ettr-serve", daemon=True)
    thread.start()
    return MetricsServer(httpd=httpd, thread=thread)


class _SaidOnce(logging.Filter):
    """Warnings said while reading the fleet, each said by the first scrape that meets it and not again
    while every scrape after it says the same (again once it was gone for a scrape).

    A ledger's damage is found anew on every read (`skipped 3 unreadable ledger records` of a job accounted
    from its events: a shared ledger's jobs are never cached), so an exporter scraped every 15 s printed the
    same lines 5,760 times a day."""

    def __init__(self) -> None:
        super().__init__()
        self._before: set[str] = set()
        self._now: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        self._now.add(message)
        return message not in self._before

    @contextlib.contextmanager
    def scrape(self) -> Iterator[None]:
        target = logging.getLogger("ettr")
        target.addFilter(self)
        try:
            yield
        finally:
            target.removeFilter(self)
            self._before, self._now = self._now, set()


Read = Callable[[float], tuple[list[JobSummary], list[str]]]


class BoundedReads:
    """`read(now)` within a scrape's budget: a read still going after `budget_s` goes on in the background,
    and the call returns the newest complete read instead (a first read, with nothing to serve yet, is
    waited for). At most one read runs at a time; a scrape that comes while one runs waits for that one.

    Counters stay monotonic: what is served is never older than what an earlier call served. `served_age_s`
    is how old the last served read was when served (0.0 when read for that call), for the
    `ettr_serve_read_age_seconds` gauge."""

    def __init__(self, read: Read, *, budget_s: float) -> None:
        self._read = read
        self._budget_s = budget_s
        self._cond = threading.Condition()
        self._running: threading.Thread | None = None
        self._newest: tuple[float, list[JobSummary], list[str]] | None = None  # (read at, jobs, problems)
        self._slow_said = False
        self.served_age_s = 0.0

    def __call__(self, now: float) -> tuple[list[JobSummary], list[str]]:
        with self._cond:
            if self._running is None:
                self._running = threading.Thread(
                    target=self._run, args=(now,), name="ettr-serve-read", daemon=True
                )
                self._running.start()
            running = self._running
            self._cond.wait_for(lambda: self._running is not running, timeout=self._budget_s)
            if self._running is running and self._newest is None:
                self._cond.wait_for(lambda: self._running is not running)  # nothing to serve yet
            if self._newest is None:  # (never: a finished read always leaves one)
                return [], []
            read_at, jobs, problems = self._newest
            self.served_age_s = max(0.0, now - read_at) if self._running is running else 0.0
            if self._running is running and not self._slow_said:
                self._slow_said = True
                logger.warning(
                    "ettr serve: reading the fleet takes over %.0f s (a ledger server slow or stalled?): "
                    "scrapes serve the newest complete read meanwhile (ettr_serve_read_age_seconds)",
                    self._budget_s,
                )
            elif self._running is not running:
                self._slow_said = False
            return jobs, problems

    def _run(self, now: float) -> None:
        try:
            jobs, problems = self._read(now)
        except Exception as exc:  # noqa: BLE001 - the read says what failed; never a dead reader
            jobs, problems = [], [f"{type(exc).__name__}: {exc}"]
        with self._cond:
            self._newest = (now, jobs, problems)
            self._running = None
            self._cond.notify_all()


def loader(args: argparse.Namespace) -> Callable[[float], tuple[list[JobSummary], list[str]]]:
    """The scrape-time loader of the flags' sources, with a cache of finished jobs."""
    from ettr.fleet.command import load_jobs, make_cache
    from ettr.untrusted import printable

    cache = make_cache(args)
    lock = threading.Lock()  # one load at a time: concurrent scrapes would read every ledger twice
    named: set[str] = set()  # the problems said on stderr and still there
    repeats = _SaidOnce()

    def load(now: float) -> tuple[list[JobSummary], list[str]]:
        with lock:
            try:
                with repeats.scrape():
                    jobs, problems = load_jobs(args, now=now, cache=cache, cmd="serve")
            except UsageError as exc:  # e.g. the folder is empty for now: serve what there is (nothing)
                jobs, problems = [], [str(exc).removeprefix("ettr serve: ")]
            except Exception as exc:  # noqa: BLE001 - a scrape says what failed, never an HTTP 500
                logger.warning("ettr serve: this scrape read no jobs (%s: %s)", type(exc).__name__, exc)
                return [], [f"{type(exc).__name__}: {exc}"]
            # What ettr_jobs_unreadable counts, each named once when a scrape first meets it (again if it
            # comes back after it was gone): the operator learns which ledger and why, not only how many.
            for problem in problems:
                if problem not in named:
                    logger.warning("ettr serve: skipped %s", printable(problem))
            named.clear()
            named.update(problems)
            return jobs, problems

    return load


def serve_forever(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; exit status 0."""
    from pathlib import Path

    for given in args.run_dirs:  # bad sources fail now, with one line, not at the first scrape
        if not Path(given).exists():
            raise UsageError(f"ettr serve: {given}: no such file or directory (give run directories)")
        if not Path(given).is_dir():
            raise UsageError(
                f"ettr serve: {given}: not a directory (give run directories or folders of them)"
            )
    if args.ledger:  # a URL that can never be read is bad input now (a server that is down is not)
        from ettr.ledger.url import scheme_of, sqlite_path

        try:
            if scheme_of(args.ledger) == "sqlite":
                sqlite_path(args.ledger)
        except UsageError as exc:
            raise UsageError(f"ettr serve: {exc}") from None
    server = start_server(
        BoundedReads(loader(args), budget_s=SCRAPE_BUDGET_S), port=args.port, addr=args.addr
    )
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    print(f"ettr serve: metrics at http://{args.addr}:{server.port}/metrics (SIGTERM or Ctrl-C stops)",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
    return 0

"""`ettr serve`: a Prometheus `/metrics` endpoint over run directories or a shared ledger.

Each scrape re-reads the fleet; finished jobs whose ledger did not change come from a cache, so a scrape
costs about the running jobs' events. Uses prometheus-client's own HTTP server (a thread).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from ettr.errors import UsageError
from ettr.fleet.model import JobSummary

logger = logging.getLogger("ettr")


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
    load: Callable[[float], tuple[list[JobSummary], list[str]]], *, port: int, addr: str = "127.0.0.1"
) -> MetricsServer:
    """Serve the metrics of `load(now)` at http://addr:port/metrics (port 0: any free port)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise UsageError(
            "ettr serve: needs prometheus-client (install it: pip install 'prometheus-client>=0.17')"
        ) from None

    from ettr.fleet.metrics import FleetCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(load))
    try:
        httpd, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise UsageError(f"ettr serve: cannot listen on {addr}:{port} ({exc.strerror or exc})") from None
    return MetricsServer(httpd=httpd, thread=thread)


def loader(args: argparse.Namespace) -> Callable[[float], tuple[list[JobSummary], list[str]]]:
    """The scrape-time loader of the flags' sources, with a cache of finished jobs."""
    from ettr.fleet.command import load_jobs, make_cache

    cache = make_cache(args)
    lock = threading.Lock()  # one load at a time: concurrent scrapes would read every ledger twice

    def load(now: float) -> tuple[list[JobSummary], list[str]]:
        with lock:
            try:
                return load_jobs(args, now=now, cache=cache, cmd="serve")
            except UsageError as exc:  # e.g. the folder is empty for now: serve what there is (nothing)
                return [], [str(exc)]

    return load


def serve_forever(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; exit status 0."""
    from pathlib import Path

    for given in args.run_dirs:  # bad sources fail now, with one line, not at the first scrape
        if not Path(given).exists():
            raise UsageError(f"ettr serve: {given}: no such file or directory (give run directories)")
    server = start_server(loader(args), port=args.port, addr=args.addr)
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

"""Numbers more than one module relies on, named once: exit statuses, time units, default sizes."""

from __future__ import annotations

EXIT_COMPLETED = 0
"""`ettr run`: the job completed."""
EXIT_FAILED = 1
"""`ettr run`: the job failed after its restarts were used up."""
EXIT_USAGE = 2
"""Every command: bad usage or bad input (one line on stderr)."""
EXIT_PREEMPTED = 143
"""128 + SIGTERM: preempted and not restarted (`ettr run`), or a job that saved on SIGTERM and exits."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT: `ettr run` interrupted by the user (Ctrl-C) and not restarted, as a shell reports it."""

SECONDS_PER_HOUR = 3_600.0
SECONDS_PER_DAY = 86_400.0

DEFAULT_STORE_MAX_BYTES = 8 * 1024**3
"""Size bound of a compile-artifact store unless configured otherwise (8 GiB)."""

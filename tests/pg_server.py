"""A throwaway PostgreSQL server for tests and benchmarks: initdb in a temp dir, start, stop, remove. It lives
with the tests and is not part of the ettr package.

Uses the server binaries of the machine (`pg_ctl`, `initdb`: on PATH, in `$ETTR_PG_BIN`, or Debian's
`/usr/lib/postgresql/<version>/bin`). PostgreSQL refuses to run as root; as root the server runs as the
`postgres` user (`runuser`). TCP on 127.0.0.1 asks for a password (scram), so tests can try a wrong one; each
server has its own random password (`PostgresServer.password`, kept 0600 in the server's 0700 directory, where
its Unix socket lives too, so that a kept server starts again).
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from ettr.supervisor.launch import free_port

USER = "ettr"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be started here (no binaries, or root without a `postgres` user)."""


def find_bin_dir() -> Path:
    """The directory holding `initdb` and `pg_ctl`. Raises `PostgresUnavailable`."""
    candidates = [os.environ.get("ETTR_PG_BIN", "")]
    found = shutil.which("pg_ctl")
    candidates.append(os.path.dirname(found) if found else "")
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for directory in candidates:
        if directory and os.access(os.path.join(directory, "initdb"), os.X_OK):
            return Path(directory)
    raise PostgresUnavailable("no PostgreSQL server binaries (initdb, pg_ctl) found; install postgresql")


class PostgresServer:
    """One private server. `start()` (initdb on first use), `stop()`, `remove()`; `url` to connect.

    Args:
        base_dir: where its data directory and socket go (default a fresh temp dir).
        port: the TCP port on 127.0.0.1 (default a free one).
        durable: fsync commits as a production server does (benchmarks); tests run without (faster).
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        durable: bool = False,
    ) -> None:
        self.durable = durable
        self.bin_dir = find_bin_dir()
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="ettr-pg-"))
        self.data_dir = self.base_dir / "data"
        self.port = port or free_port()
        self._password_file = self.base_dir / "password"
        self.password = (
            self._password_file.read_text().strip()
            if self._password_file.is_file()
            else secrets.token_urlsafe(24)
        )
        """This server's password for `USER`: random per server (nothing fixed to guess), kept beside it."""
        self._run_as: list[str] = []
        self._paused: list[int] = []
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable(
                    "running as root and there is no 'postgres' user to run the server"
                ) from None
            self._run_as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/postgres"

    def url_with_password(self, password: str) -> str:
        return f"postgresql://{USER}:{password}@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str | os.PathLike[str], timeout_s: float = 60.0) -> None:
        cmd = [*self._run_as, *map(str, argv)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            detail = " ".join((done.stderr or done.stdout).split())[-400:]
            raise PostgresUnavailable(f"{' '.join(cmd)} failed ({done.returncode}): {detail}")

    def _initdb(self) -> None:
        # Private: the Unix socket (trusted, `--auth-local=trust`) and the password file live here.
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.base_dir.chmod(0o700)
        fd = os.open(self._password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.password + "\n")
        if self._run_as:
            owner = pwd.getpwnam("postgres")
            for path in (self.base_dir, self._password_file):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        self._run(
            self.bin_dir / "initdb", "-D", self.data_dir, "-U", USER, "--pwfile", self._password_file,
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync",
        )  # fmt: skip

    def start(self) -> None:
        """Start the server (creating its data directory the first time). Raises `PostgresUnavailable`."""
        if not (self.data_dir / "PG_VERSION").is_file():
            self._initdb()
        elif not self._password_file.is_file():
            raise PostgresUnavailable(
                f"{self.data_dir} holds a server without its password file; remove {self.base_dir} to start afresh"
            )
        options = f"-p {self.port} -k {self.base_dir} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off"
        self._run(
            self.bin_dir / "pg_ctl", "-D", self.data_dir, "-o", options, "-l", self.base_dir / "server.log",
            "-w", "-t", "60", "start",
        )  # fmt: skip

    def stop(self) -> None:
        """Stop the server now (fast: sessions are ended, what was committed stays)."""
        if (self.data_dir / "postmaster.pid").exists():
            self._run(self.bin_dir / "pg_ctl", "-D", self.data_dir, "-m", "fast", "-w", "stop")

    def pids(self) -> list[int]:
        """The postmaster's pid and its children's (the server's processes), or [] when it is not running."""
        try:
            postmaster = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return []
        found = [postmaster]
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                found.append(int(name))
        return found

    def pause(self) -> None:
        """Stall the server: SIGSTOP every process of it. TCP stays up (the kernel still accepts and
        acknowledges), but nothing answers: neither TCP timeouts nor the server's statement timeout fire."""
        self._paused = self.pids()
        for pid in self._paused:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # a session's backend that ended between the listing and now
                pass

    def resume(self) -> None:
        """Undo `pause` (SIGCONT to the processes it stopped, and any of the server's now)."""
        for pid in {*self._paused, *self.pids()}:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self._paused = []

    def remove(self) -> None:
        """Stop the server and delete its files."""
        self.resume()  # a stalled server cannot stop
        try:
            self.stop()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

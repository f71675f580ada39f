"""A throwaway single-node Slurm cluster for tests: munged, slurmctld and slurmd from Debian's packages
(`make slurm` installs them), configured in a temporary directory. It lives with the tests and is not part of
the ettr package (it runs its daemons as root).

    cluster = SlurmCluster(); cluster.start()      # raises SlurmUnavailable with the reason
    done = cluster.run("sbatch", "--parsable", "job.sh")
    cluster.remove()                              # stops the daemons, deletes the directory

Needs root (SlurmUser=root) and the daemons on PATH or in /usr/sbin. Everything of the cluster (state, spool,
pid and log files, slurm.conf) lives in its directory; the clients find it through `SLURM_CONF` in
`cluster.env()`. Ports are picked free. The node is `localhost` with 2 CPUs; `JobRequeue=1`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from ettr.atomic import atomic_write
from ettr.supervisor.launch import free_port

_SBIN = ("/usr/sbin", "/usr/bin", "/sbin")


class SlurmUnavailable(RuntimeError):
    """No cluster can be started here (not root, daemons missing, a daemon did not come up)."""


def _find(name: str) -> str:
    found = shutil.which(name) or next(
        (str(Path(d) / name) for d in _SBIN if (Path(d) / name).exists()), None
    )
    if found is None:
        raise SlurmUnavailable(f"{name} is not installed (`make slurm` installs Debian's slurm packages)")
    return found


def slurm_conf(directory: Path, *, ctld_port: int, slurmd_port: int, cpus: int = 2) -> str:
    """The minimal slurm.conf of a one-node cluster kept in `directory`."""
    d = directory
    return f"""ClusterName=ettr-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
KillWait=5
MinJobAge=600
NodeName=localhost CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """One single-node cluster in a temporary directory (see the module docstring)."""

    def __init__(self, *, start_timeout_s: float = 60.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ettr-slurm-"))
        self.start_timeout_s = start_timeout_s
        self._daemons: list[subprocess.Popen[bytes]] = []
        self._munged_started = False

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment whose Slurm clients talk to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (sbatch, scontrol, squeue, ...) against this cluster."""
        return subprocess.run(
            [_find(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout,
            env=self.env(), check=False,
        )  # fmt: skip

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster runs its daemons as root (SlurmUser=root)")
        munged, slurmctld, slurmd = _find("munged"), _find("slurmctld"), _find("slurmd")
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        atomic_write(self.conf, slurm_conf(self.dir, ctld_port=free_port(), slurmd_port=free_port()).encode())
        self._start_munged(munged)
        env = self.env()
        self._daemons.append(
            subprocess.Popen([slurmctld, "-D", "-i", "-f", str(self.conf)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )  # fmt: skip
        self._daemons.append(
            subprocess.Popen([slurmd, "-D", "-N", "localhost", "-f", str(self.conf)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )  # fmt: skip
        try:
            self._wait_idle()
        except SlurmUnavailable:
            self.remove()
            raise

    def _start_munged(self, munged: str) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True, check=False).returncode == 0:
            return  # one munged serves every cluster of this machine
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        done = subprocess.run([munged, "--force"], capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise SlurmUnavailable(f"munged --force failed: {done.stderr.strip()}")
        self._munged_started = True

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        last = ""
        while time.monotonic() < deadline:
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise SlurmUnavailable(f"a Slurm daemon exited ({daemon.args!r}): {self._log_tail()}")
            done = self.run("sinfo", "-h", "-o", "%t", timeout=10)
            last = (done.stdout + done.stderr).strip()
            if done.returncode == 0 and last in ("idle", "mix", "alloc"):
                return
            time.sleep(0.5)  # the daemons come up in their own time
        raise SlurmUnavailable(f"the node did not become idle in {self.start_timeout_s:g} s ({last})")

    def _log_tail(self) -> str:
        lines: list[str] = []
        for name in ("slurmctld.log", "slurmd.log"):
            try:
                lines += (self.dir / name).read_text(errors="replace").splitlines()[-2:]
            except OSError:
                pass
        return " | ".join(lines) or "no log"

    def remove(self) -> None:
        """Cancel every job, stop the daemons, delete the directory."""
        if self._daemons:
            self.run("scancel", "--full", "--user=root", timeout=10) if self._daemons[
                0
            ].poll() is None else None
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self._daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

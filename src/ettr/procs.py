"""Processes on this host, from /proc: start ticks, liveness, descendants, environments, and the
parent-death and child-subreaper settings; the scheduling of ettr's own background work (a standby at
`SCHED_IDLE` and back; a thread or process made nicer, with the lowest best-effort I/O priority).

The one place ettr reads `/proc/<pid>/stat`. A pid alone does not name a process for long (pids are
reused), so whoever records a pid to check later records its start ticks beside it
(`start_ticks(os.getpid())`) and asks `pid_alive(pid, ticks)`.

Liveness policy (one for every caller: the supervisor's books, `ettr report`, the publish queue):
- start ticks recorded and /proc readable: alive iff a process with that pid exists and started at those
  ticks (a later process that reuses the pid is not the one recorded);
- start ticks recorded but no /proc on this host (not Linux): alive iff the pid exists (`kill(pid, 0)`);
- start ticks unknown (the writer had no /proc): alive iff the pid exists. A reused pid then reads as alive:
  the caller errs towards "still running" (a report shows the job live, a stale claim waits for its lease to
  expire) rather than taking over work that may still be in progress.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import signal
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_PROC = "/proc"

Prctl = Callable[[int, int, int, int, int], int]


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of `/proc/<pid>/stat` after the command name (field 3 of stat(5) is index 0)."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (None: no such process, or no /proc)."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else int(fields[19])  # field 22 of stat(5)
    except (ValueError, IndexError):
        return None


def pid_space() -> str | None:
    """This host's boot and this process's PID namespace (`BOOT_ID pid:[INODE]`): a process that recorded the
    same can be looked up here by its pid (`running`); another container on the same host shares the boot,
    not the namespace. None where /proc does not say."""
    try:
        boot = Path(_PROC, "sys/kernel/random/boot_id").read_text().strip()
        space = os.readlink(f"{_PROC}/self/ns/pid")
    except OSError:
        return None
    return f"{boot} {space}" if boot and space and " " not in boot + space else None


def run_state(pid: int) -> str | None:
    """The kernel's state letter of process `pid` (`R` running, `S` asleep, `D` uninterruptible I/O, `T`
    stopped, `Z` zombie, ...; field 3 of stat(5)); None: no such process, or no /proc."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else fields[0].decode("ascii", "replace")
    except IndexError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """CPU time process `pid` has used so far, user and system (None: no such process, or no /proc)."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError, OSError):  # fields 14 and 15 of stat(5)
        return None


def tree_cpu_seconds(root: int) -> float | None:
    """CPU time used so far by process `root` and its live descendants, user and system, with what each of
    them has collected from children it waited for (so a worker that exited and was waited for still
    counts); None: no such process, or no /proc. A descendant that outlived its parent and went to a
    process outside the tree is missed from then on."""
    total = 0.0
    for pid in [root, *_descendant_pids(root)]:
        fields = _stat_fields(pid)
        try:
            if fields is not None:  # fields 14-17 of stat(5): utime, stime, cutime, cstime
                total += sum(int(fields[i]) for i in (11, 12, 13, 14))
            elif pid == root:
                return None
        except (ValueError, IndexError):
            if pid == root:
                return None
    return total / os.sysconf("SC_CLK_TCK")


def cpus_busy_seconds(cpus: Collection[int]) -> float | None:
    """Seconds the CPUs `cpus` have spent busy since boot, whoever ran on them (from /proc/stat: user, nice,
    system, irq, softirq and steal time); None where /proc/stat cannot say for one of them."""
    wanted = {f"cpu{cpu}" for cpu in cpus}
    try:
        with open(f"{_PROC}/stat", "rb") as f:
            lines = f.read().decode("ascii", "replace").splitlines()
    except OSError:
        return None
    ticks = 0
    found = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = rest.split()
            try:  # user nice system idle iowait irq softirq steal ...
                ticks += sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7))
            except (ValueError, IndexError):
                return None
            found += 1
    return ticks / os.sysconf("SC_CLK_TCK") if found == len(wanted) else None


def _parent_pid(pid: int | str) -> int | None:
    fields = _stat_fields(pid)
    try:
        return None if fields is None else int(fields[1])  # field 4 of stat(5)
    except (ValueError, IndexError):
        return None


def process_start_time() -> float:
    """Unix time at which this process started (from /proc when available, else now)."""
    ticks = start_ticks(os.getpid())
    try:
        if ticks is None:
            raise ValueError("no /proc")
        with open(f"{_PROC}/uptime", "rb") as f:
            uptime_s = float(f.read().split()[0])
        return time.time() - max(0.0, uptime_s - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


_PID_T_MAX = 2**31 - 1
"""The largest pid a kernel can give (`pid_t` is 32 bits; Linux gives at most 2**22): `os.kill` raised
OverflowError for a larger one, out of `ettr report` for a forged SUPERVISOR_START."""


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; it is someone else's
    except OSError:
        return False
    return True


def pid_alive(pid: int, recorded_ticks: int | None) -> bool:
    """Whether the process recorded as (`pid`, `recorded_ticks`) still runs on this host (policy above). A pid
    no process can have (beyond `pid_t`: books anyone can write may name 2**31 or 10**20) is not running."""
    if not 0 < pid <= _PID_T_MAX:
        return False
    if recorded_ticks is None or not os.path.isdir(_PROC):
        return _pid_exists(pid)
    return start_ticks(pid) == recorded_ticks


def running(pid: int, recorded_ticks: int | None) -> bool:
    """Whether the process recorded as (`pid`, `recorded_ticks`) still runs: `pid_alive`, and not a zombie
    (a process that exited and waits for its parent to collect its status is not running)."""
    if not pid_alive(pid, recorded_ticks):
        return False
    fields = _stat_fields(pid)
    if fields is None:
        return not os.path.isdir(_PROC)  # no /proc: `pid_alive` is all there is
    return fields[0] != b"Z"


def descendants(root: int) -> list[tuple[int, int | None]]:
    """(pid, start ticks) of every live descendant of `root`, from /proc; empty where /proc is missing."""
    return [(pid, start_ticks(pid)) for pid in _descendant_pids(root)]


def _descendant_pids(root: int) -> list[int]:
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for entry in entries:
        if entry.isdigit():
            ppid = _parent_pid(entry)
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


@functools.cache
def libc_prctl() -> Prctl | None:
    """libc's `prctl`, or None where there is none (resolve it before a fork: the child only calls it). Resolved
    once: each `ctypes.CDLL` makes a class of its own, and the supervisor resolved it at every process it
    started (a soak's tracemalloc: +66 KiB in 20 restarts, the largest growth after the stderr buffers)."""
    try:
        prctl: Prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def set_parent_death_signal(sig: int = signal.SIGKILL, prctl: Prctl | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux only); whether set."""
    prctl = prctl or libc_prctl()
    if prctl is None:
        return False
    return bool(prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)


def set_child_subreaper(prctl: Prctl | None = None) -> bool:
    """Make this process the reaper of its orphaned descendants (Linux `PR_SET_CHILD_SUBREAPER`): a process
    whose parent exits (a double fork, a shell's child) is re-parented here instead of to init, so it stays
    a descendant. Whether set. The caller must then reap what it adopts."""
    prctl = prctl or libc_prctl()
    if prctl is None:
        return False
    return bool(prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper (`set_child_subreaper`; Linux `PR_GET_CHILD_SUBREAPER`)."""
    prctl = libc_prctl()
    if prctl is None:
        return False
    flag = ctypes.c_int(0)
    ok = prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0  # type: ignore[arg-type]
    return ok and flag.value != 0


def environ_of(pid: int) -> dict[str, str] | None:
    """The environment process `pid` was started with (`/proc/<pid>/environ`); None if unreadable (gone,
    another user's, no /proc)."""
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def cmdline_of(pid: int) -> list[str] | None:
    """The command line process `pid` runs now (`/proc/<pid>/cmdline`: after an `exec`, the new program's);
    None if unreadable (gone, no /proc)."""
    try:
        with open(f"{_PROC}/{pid}/cmdline", "rb") as f:
            raw = f.read(1 << 16)
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else None


def processes_with_env(wanted: dict[str, str]) -> list[tuple[int, int | None, dict[str, str]]]:
    """(pid, start ticks, environment) of every process on this host (but this one) whose environment has
    every `wanted` variable with that value; empty where /proc is missing."""
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return []
    found = []
    me = os.getpid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        env = environ_of(int(entry))
        if env is not None and all(env.get(k) == v for k, v in wanted.items()):
            found.append((int(entry), start_ticks(int(entry)), env))
    return found


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` right now (zombies included); empty where /proc is missing."""
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return []
    return [int(e) for e in entries if e.isdigit() and _parent_pid(e) == pid]


def ancestors(pid: int) -> list[int]:
    """The parent, grandparent, ... of `pid` up to init, from /proc; empty where /proc is missing."""
    found: list[int] = []
    parent = _parent_pid(pid)
    while parent is not None and parent > 0 and parent not in found:
        found.append(parent)
        parent = _parent_pid(parent)
    return found


def handles_signal(pid: int, sig: int) -> bool:
    """Whether process `pid` catches `sig` with a handler of its own (its `SigCgt` mask in
    `/proc/<pid>/status`: a Python process has one for each signal it gave a Python handler); False where
    it cannot be read (gone, no /proc)."""
    try:
        with open(f"{_PROC}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def topmost_handlers(
    pids: Collection[int],
    sig: int,
    *,
    handles: Callable[[int, int], bool] = handles_signal,
    parent_of: Callable[[int], int | None] | None = None,
) -> list[int]:
    """Those of `pids` that handle `sig` themselves (`handles`) and have no ancestor among `pids` that does:
    a training process, not the data-loader workers it forked (they inherit its handlers), nor what a
    launcher that handles `sig` itself started."""
    parent = parent_of or _parent_pid
    among = set(pids)
    handling = {pid for pid in among if handles(pid, sig)}
    found = []
    for pid in pids:
        if pid not in handling:
            continue
        up, seen = parent(pid), {pid}
        while up is not None and up > 0 and up not in seen and up in among:
            if up in handling:
                break
            seen.add(up)
            up = parent(up)
        else:
            found.append(pid)
    return found


def signal_pids(pids: Collection[int], sig: int) -> list[int]:
    """`sig` to each of `pids` (those gone or not ours skipped); the pids it was sent to."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        sent.append(pid)
    return sent


def idle_scheduling(pid: int) -> bool:
    """Put process `pid` at `SCHED_IDLE` (CPU only when nothing else wants it), only where it may return to
    `SCHED_OTHER` afterwards: tried both ways first (privilege, CAP_SYS_NICE or the process's RLIMIT_NICE
    decide it). Threads it starts later inherit the policy. Whether it is idle now; never raises (Linux)."""
    idle, normal = getattr(os, "SCHED_IDLE", None), getattr(os, "SCHED_OTHER", None)
    if idle is None or normal is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(pid, idle, os.sched_param(0))
        os.sched_setscheduler(pid, normal, os.sched_param(0))  # the way back must work, or it stays normal
        os.sched_setscheduler(pid, idle, os.sched_param(0))
    except OSError:
        try:
            os.sched_setscheduler(pid, normal, os.sched_param(0))
        except OSError:
            pass
        return False
    # In a session of its own the process's autogroup competes with the others as a whole, with the weight of
    # the autogroup's nice value, not its tasks' idle policy: that goes down too (back to 0 needs no privilege).
    set_autogroup_nice(pid, AUTOGROUP_IDLE_NICE)
    return True


AUTOGROUP_IDLE_NICE = 19
"""The nice value of the autogroup of a process at idle priority that leads its own session."""


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Set the nice value of the autogroup (the kernel's CPU share per session, `sched_autogroup`) of `pid`,
    only where `pid` leads its session (so the group is its own) and autogroups are on. Whether it was set;
    never raises."""
    try:
        if (
            os.getsid(pid) != pid
            or Path(f"{_PROC}/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1"
        ):
            return False
        with open(f"{_PROC}/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        return True
    except (OSError, ValueError):
        return False


def normal_scheduling(pid: int) -> bool:
    """Every thread of process `pid` that is at `SCHED_IDLE` back to `SCHED_OTHER` (twice over the task
    list: a thread started meanwhile by one not yet moved inherits the idle policy). Whether none is left
    idle; never raises."""
    idle, normal = getattr(os, "SCHED_IDLE", None), getattr(os, "SCHED_OTHER", None)
    if idle is None or normal is None or not hasattr(os, "sched_setscheduler"):
        return True
    set_autogroup_nice(pid, 0)
    left = False
    for _ in range(2):
        left = False
        for tid in tasks(pid):
            try:
                if os.sched_getscheduler(tid) == idle:
                    os.sched_setscheduler(tid, normal, os.sched_param(0))
            except ProcessLookupError:
                continue  # a thread that ended meanwhile
            except OSError:
                left = True
    return not left


def nicer_scheduling(pid: int, nice: int) -> bool:
    """Make process `pid` (every task it has now; threads and children it starts later inherit it) `nice`
    nicer, only where it may come back to nice 0 afterwards (`normal_priority`): tried both ways first, as
    `idle_scheduling` does (privilege, CAP_SYS_NICE or RLIMIT_NICE decide it). Its autogroup too where it
    leads its session. Unlike SCHED_IDLE, a nice process still gets a share of a busy CPU. Whether it is
    nicer now; never raises."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        os.setpriority(os.PRIO_PROCESS, pid, 0)  # the way back must work, or it stays at 0
        for tid in tasks(pid):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        normal_priority(pid)
        return False
    set_autogroup_nice(pid, nice)
    return True


def normal_priority(pid: int, others: Collection[int] = ()) -> bool:
    """Every task of process `pid` and of `others` (its descendants) back to nice 0, and its autogroup (twice
    over the task lists: a thread started meanwhile inherits the old value). Whether none is left nicer;
    never raises."""
    if not hasattr(os, "setpriority"):
        return True
    set_autogroup_nice(pid, 0)
    left = False
    for _ in range(2):
        left = False
        for tid in [t for p in (pid, *others) for t in tasks(p)]:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                    os.setpriority(os.PRIO_PROCESS, tid, 0)
            except ProcessLookupError:
                continue
            except OSError:
                left = True
    return not left


def tasks(pid: int) -> list[int]:
    """The thread ids (tasks) of process `pid`, from /proc; `[pid]` where they cannot be listed (Linux keeps
    scheduling settings such as nice and the policy per task)."""
    try:
        return [int(name) for name in os.listdir(f"{_PROC}/{pid}/task")]
    except (OSError, ValueError):
        return [pid]


# -- nicer background work (the async persist, compile-store saves) ------------------------------------
_logger = logging.getLogger("ettr")

NICE_STEP = 10
"""How much nicer than training ettr's background work runs (nice values go up to 19)."""

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_SHIFT = 13
_LOWEST_BE_LEVEL = 7


def lower_priority(pid: int, *, whole_process: bool = False, nice_step: int = NICE_STEP) -> bool:
    """Lower the CPU priority of task `pid` by `nice_step` (every task of process `pid` with `whole_process`)
    and its I/O priority to the lowest best-effort level. Returns whether the CPU priority was lowered for
    at least one task."""
    tids = tasks(pid) if whole_process else [pid]
    lowered = False
    for tid in tids:
        lowered = _nice(tid, nice_step) or lowered
        _ioprio_lowest(tid)
    return lowered


def lower_this_thread(*, nice_step: int = NICE_STEP) -> bool:
    """Lower the priority of the calling thread only (Linux: nice and ioprio are per thread)."""
    return lower_priority(threading.get_native_id(), nice_step=nice_step)


def _nice(tid: int, nice_step: int = NICE_STEP) -> bool:
    if not hasattr(os, "setpriority"):
        _logger.debug("ettr: no os.setpriority here; background work keeps training's CPU priority")
        return False
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice_step))
        return True
    except OSError as exc:
        _logger.debug("ettr: cannot lower the CPU priority of task %d (%s)", tid, exc)
        return False


def _ioprio_lowest(tid: int) -> bool:
    number = _IOPRIO_SET.get(platform.machine()) if os.name == "posix" else None
    if number is None or platform.system() != "Linux":
        _logger.debug("ettr: no ioprio_set on this platform; background work keeps training's I/O priority")
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | _LOWEST_BE_LEVEL
        if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, value) != 0:
            _logger.debug("ettr: ioprio_set for task %d failed (errno %d)", tid, ctypes.get_errno())
            return False
        return True
    except (OSError, AttributeError) as exc:
        _logger.debug("ettr: ioprio_set unavailable (%s)", exc)
        return False


def io_priority(tid: int) -> int | None:
    """The raw I/O priority of task `tid` (ioprio_get), for tests; None where unavailable."""
    number = {"x86_64": 252, "aarch64": 31, "ppc64le": 274, "s390x": 283}.get(platform.machine())
    if number is None or platform.system() != "Linux":
        return None
    try:
        value = int(ctypes.CDLL(None, use_errno=True).syscall(number, _IOPRIO_WHO_PROCESS, tid))
    except (OSError, AttributeError):
        return None
    return None if value < 0 else value


def oom_kill_count(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """The OOM-kill counter of this process's memory cgroup, or None where it cannot be read.

    cgroup v2: `memory.events`' `oom_kill`, under `root` or, in a hybrid layout, under `root/unified`
    (where it has the memory controller); cgroup v1: `memory.oom_control`'s `oom_kill` (Linux 4.13+) under
    `root/memory` (a node with v1 memory cgroups read None: every OOM kill was `process_lost`). Only this
    process's own cgroup: a parent's counter would count other jobs' kills.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if not controllers:
            candidates += [root / rel / "memory.events", root / "unified" / rel / "memory.events"]
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / rel / "memory.oom_control")
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for row in text.splitlines():
            key, _, value = row.partition(" ")
            if key == "oom_kill":
                try:
                    return int(value)
                except ValueError:
                    return None
    return None


def _fd_target(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(f"{_PROC}/{pid}/fd/{fd}")
    except OSError:
        return None


def _is_python(pid: int) -> bool:
    try:
        return os.path.basename(os.readlink(f"{_PROC}/{pid}/exe")).startswith("python")
    except OSError:
        return False


def log_readers(pids: Collection[int]) -> set[int]:
    """Those of `pids` that read, on their stdin, a pipe a Python process of `pids` writes to on its stdout
    or stderr, and are no Python process themselves: the `tee` of `torchrun ... 2>&1 | tee train.log`. A
    signal that stops a job should not reach them first: they end by themselves at the end of what they read,
    and, killed first, a rank's print (`saving checkpoint to ...`) in its own SIGTERM handler died of a broken
    pipe before its save. A Python reader (`cat data | python train.py`) is none."""
    written: set[str] = set()
    for pid in pids:
        if _is_python(pid):
            for fd in (1, 2):
                target = _fd_target(pid, fd)
                if target is not None and target.startswith("pipe:"):
                    written.add(target)
    if not written:
        return set()
    return {pid for pid in pids if _fd_target(pid, 0) in written and not _is_python(pid)}


def close_quietly(*fds: int) -> None:
    """Close each of `fds`, one already closed (or never open) being no error."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass

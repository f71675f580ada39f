"""The events the watch over one attempt hears and the actions it asks of its driver
(`ettr.supervisor.watch`, whose module docstring has the rules)."""

from __future__ import annotations

from dataclasses import dataclass


# -- events ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Signalled:
    """The supervisor has received `count` signals so far, the first being `signum`."""

    signum: int
    count: int
    from_terminal: bool = False
    """A Ctrl-C the terminal delivered to the whole foreground process group, the job included."""
    insisted: bool | None = None
    """A later signal insists (`SupervisorSignals.insisted`): no more grace. None: any second signal does."""

    @property
    def insists(self) -> bool:
        return self.count >= 2 if self.insisted is None else self.insisted


@dataclass(frozen=True)
class Hung:
    """The hang watchdog saw no progress and no heartbeat for `silence_s`, over `bound` (which one, for
    people); `last_sign_at`: the last sign of life (when the fault happened, as far as anyone knows)."""

    silence_s: float
    bound: str = ""
    last_sign_at: float | None = None
    ranks: str = ""  # what each training process was doing, as far as the supervisor knows


@dataclass(frozen=True)
class PeerLost:
    """Another node ends this attempt (its part failed, or its supervisor is lost): `reason`, for people."""

    reason: str


@dataclass(frozen=True)
class RankFailed:
    """A process of the attempt died with a FAILURE on record while its launcher runs on."""


@dataclass(frozen=True)
class Exiting:
    """Every process of the attempt still running has done its Python-level exit (only interpreter
    teardown is left: no heartbeat beats, and that is not a hang)."""


@dataclass(frozen=True)
class Exited:
    """The attempt's command is over: `returncode` (negative: killed by that signal); `at`, when the attempt
    itself knew its failure (ettr's agent: the failed worker's exit), if earlier than the supervisor's look;
    `outlived`: processes of the job still run (a wrapper died before the python it started)."""

    returncode: int
    at: float | None = None
    outlived: bool = False


@dataclass(frozen=True)
class Continued:
    """A worker failed and the others go on in place (`ettr.supervisor.inplace`): the attempt is over as far
    as the books go, but nothing is torn down; the next attempt continues in the same processes."""

    returncode: int  # the failed worker's (1 where it raised and lived on: `survived`)
    at: float | None = None  # when the attempt saw the failure
    survived: bool = False  # the failed rank raised and its wrapper caught it: no process exited


@dataclass(frozen=True)
class Drained:
    """No process of the attempt is left."""


@dataclass(frozen=True)
class Tick:
    """Time passed (every poll): deadlines fall due."""


WatchEvent = Signalled | Hung | PeerLost | RankFailed | Exiting | Exited | Continued | Drained | Tick


# -- actions --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Say:
    """Tell the person watching (one `ettr:` line)."""

    text: str


@dataclass(frozen=True)
class SendSignal:
    """Send `signum` to the attempt's processes (all of them; without the launcher: its workers only)."""

    signum: int
    include_launcher: bool = True
    to_handlers: bool = False  # only to those with a handler of their own for it (`procs.topmost_handlers`)


@dataclass(frozen=True)
class TellRanks:
    """Tell the person watching `text`, then what each training process is doing now (the driver reads it: the
    watch does no I/O), and keep that for the attempt's end (`WatchState.ranks_at_kill`)."""

    text: str


WatchAction = Say | SendSignal | TellRanks

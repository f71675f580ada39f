"""Numbers more than one module relies on, named once: exit statuses, time units, default sizes."""

from __future__ import annotations

EXIT_COMPLETED = 0
"""`ettr run`: the job completed."""
EXIT_FAILED = 1
"""`ettr run`: the job failed after its restarts were used up."""
EXIT_USAGE = 2
"""Every command: bad usage or bad input (one line on stderr)."""
EXIT_HOPELESS = 3
"""`ettr run`: restarts stopped early, the job failing the same way before making progress (the same failure
twice before the first step, restarts that reach no new step, or restarts that fail the same way at the same
place after their first step): restarts would not help."""
EXIT_PREEMPTED = 143
"""128 + SIGTERM: preempted and not restarted (`ettr run`), or a job that saved on SIGTERM and exits."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT: `ettr run` interrupted by the user (Ctrl-C) and not restarted, as a shell reports it."""

SECONDS_PER_HOUR = 3_600.0
SECONDS_PER_DAY = 86_400.0

MAX_STEP = 1 << 53
"""A global step (or a token count used as one) fits a float exactly below this: a larger one is damage (the
ledger's rows, a step tail)."""
FUTURE_MARGIN_S = 86400.0
"""Times further ahead of the reading host's clock than this are damage, not times (clocks of a job's hosts
differ by seconds; a far-future time would hide a hang for ever, or stretch a report's wall time)."""

DEFAULT_STORE_MAX_BYTES = 8 * 1024**3
"""Size bound of a compile-artifact store unless configured otherwise (8 GiB)."""

# Milestones of a restart, recorded as MARK events and read by `ettr.accounting.ttr` (the TTR's parts).
FAILURE_DETECTED_MARK = "failure_detected"
"""Supervisor MARK (attempt = the failed one): when the supervisor learned the attempt had ended."""
BACKOFF_MARK = "restart_backoff"
"""Supervisor MARK (attempt = the failed one) at the end of its wait before the next attempt; data: wait_s."""
RELAUNCH_MARK = "relaunch"
"""Supervisor MARK (attempt = the one started) at its start: how its process(es) were started and why
(`ettr.supervisor.relaunch.Relaunch`: data path warm|promoted|cold, why, and per rank under ettr's agent)."""
UNRECORDED_MARK = "unrecorded_trainers"
"""MARK the instrumented process records as it exits when processes it started with multiprocessing stepped an
optimizer without becoming ranks (`ettr.bootstrap.unrecorded`); data: pids."""
SIGNALLED_MARK = "supervisor_signalled"
"""Supervisor MARK (attempt = the running one) when a signal that stops the job reaches the supervisor (a
scheduler's SIGTERM, Slurm's SIGUSR1, Ctrl-C), whatever the attempt is doing; data: signal (its name). Written
at once, so a supervisor killed before the attempt's end (Slurm's KillWait shorter than the grace) leaves the
stop on record: the requeued run closes the attempt as preempted (interrupted for SIGINT), not as a lost node."""
RECOVERY_MARK = "recovery"
"""Supervisor MARK (attempt = the one started) of an attempt that recovers a failure in a way the relaunch does
not say: data kind (`in_place`: the job's other processes went on, the failed rank was replaced), replaced
(ranks started anew)."""
CHECKPOINT_LOAD_FAILED_MARK = "checkpoint_load_failed"
"""Rank MARK when a load of one of the job's checkpoint files raised and the file on disk is none of the saves
recorded for it (a torch.save straight to its final name cut off mid-write); data: path, exception, why. The
saves of that path committed before it are gone: the kept-step rule no longer counts on them."""
IMPORTS_MARK = "imports_done"
"""Training-process MARK: `import torch` finished in this process (ettr's bootstrap ran before it)."""
TRAINING_ENDED_MARK = "training_ended"
"""Training-process MARK (`Event.step`: the step its training ended at) when its training loop has ended: the
job has nothing left to train from that step on (`Recorder.training_ended`: `ettr.training_ended()`, the
final `CheckpointManager.finish`, `ettr.resilient` when the training function returns, Lightning's and Hugging
Face's `on_train_end`). The restart policy reads it: a restart that reaches that step and no new one is
finishing the job, not stalling (`ettr.supervisor.policy`, rule 4). Unmodified scripts record none."""
COMMIT_FLUSH_S = 1.0
"""How long a recorded checkpoint commit waits at most to be written to the books (saves are rare; the write
takes milliseconds, a ledger that cannot be written costs each commit this much): a process killed right after
a commit must not leave a resume point that its books say never existed. The zero-code hooks wait on the
training thread, ettr's checkpoint manager on its persist thread."""

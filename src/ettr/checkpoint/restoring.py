"""How a checkpoint manager restores: the newest commit every rank can load, from memory first.

`Restoring` is the restore half of `CheckpointManager` (`manager.py` is the save half and the lifecycle), a
base class that holds the steps of `CheckpointManager.restore` and nothing else. In order:

1. with memory copies (`memory.MemoryCopies`), rank 0 names the newest storage commit that verifies and is
   admitted, and draws this process lifetime's lineage token; with memory-tier commits on
   (`memory_tier`), a step newer than that commit that every rank holds is loaded first (one all-gather
   agrees on it); else each rank's memory copy of that commit (or a peer's: `memory_peers`);
2. otherwise storage: `resume.choose_checkpoint` picks the newest checkpoint that verifies, it is loaded
   through DCP with the verified reader and the safe load planner, and one that fails to load is set aside
   and the next older one tried.

Every step is collective, and every rank ends at the same step or at none. The attributes below are the
manager's (set in `CheckpointManager.__init__`): this class reads and books through them.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp

from ettr.checkpoint.admission import ALLOW_UNSIGNED_ENV, RESUME_FOREIGN_ENV, Admission, env_flag
from ettr.checkpoint.base import (
    CheckpointConfig,
    CheckpointError,
    CheckpointInvalid,
    CheckpointStorage,
    describe_error,
    step_dir_name,
)
from ettr.checkpoint.commit import Manifest, lease, list_checkpoints, verify
from ettr.checkpoint.coordination import Coordinator
from ettr.checkpoint.keys import KeyRing
from ettr.checkpoint.memory import Found, MemoryCopies, fill
from ettr.checkpoint.memory_peers import PeerPlan, fetch
from ettr.checkpoint.memory_tier import MemoryTier
from ettr.checkpoint.policy import IntervalPolicy, MemoryIntervalPolicy
from ettr.checkpoint.resume import choose_checkpoint, set_aside
from ettr.checkpoint.snapshot import Binding, Snapshot
from ettr.checkpoint.state import TrainState, saved_top_level_keys
from ettr.checkpoint.trust import SafeLoadPlanner, UnsafePickle, retry_transient, verified_reader
from ettr.events import Phase
from ettr.recorder import RecorderProtocol

logger = logging.getLogger("ettr")


class Restoring:
    """The restore steps of `CheckpointManager` (its base class; see the module docstring)."""

    config: CheckpointConfig
    state: TrainState
    storage: CheckpointStorage
    rank: int
    world_size: int
    policy: IntervalPolicy
    memory: MemoryCopies | None
    last_committed_step: int | None
    restored_from: str | None
    restored_tier: str | None
    _rec: RecorderProtocol
    _clock: Callable[[], float]
    _coord: Coordinator
    _root: str
    _ring: KeyRing
    _peers: PeerPlan | None
    _tier: MemoryTier | None
    _tier_policy: MemoryIntervalPolicy | None
    _lineage: str | None
    _tier_base: Binding | None
    _tier_not_used: str
    _memory_source: str
    _memory_not_used: str | None
    _existing_steps: set[int]
    _refused_steps: set[int]
    _warned_earlier_run: bool

    def wait(self, timeout_s: float | None = None) -> bool:
        raise NotImplementedError  # the manager's: every save done before a restore

    def _restore(self, step: int | None) -> int | None:
        self.wait()
        scanning_begin = time.time()
        self._memory_not_used = None
        self._tier_base = None
        self._tier_not_used = ""
        if self.memory is not None:
            from_memory = self._restore_from_memory(step)
            if from_memory is not None:
                base = self._tier_base
                tiered = base is not None and from_memory > base.step
                storage_step = base.step if tiered and base is not None else None
                self._resumed(from_memory, self._memory_source, scanning_begin, storage_step=storage_step)
                return from_memory
        at_most = step
        while True:
            chosen, existing, digest, authenticated = self._choose_checkpoint(step, at_most)
            self._existing_steps = set(existing)
            self._warned_earlier_run = True
            if chosen is None or (step is not None and chosen != step):
                if step is not None:
                    raise CheckpointError(
                        f"checkpoint step {step} in {self.storage.url} is missing or does not verify"
                    )
                if at_most is not None:
                    logger.error("ettr: no checkpoint in %s loads: starting from scratch", self.storage.url)
                self._rec.resumed_from(None)
                return None
            error, fatal = self._load(chosen, digest, authenticated=authenticated)
            failed, fatal = self._coord.agree(bool(error), fatal)
            if fatal:
                raise CheckpointError(
                    f"checkpoint {step_dir_name(chosen)} in {self.storage.url}, signed by this job's key, does "
                    f"not load: {error or 'on another rank'} (left in place: a changed model or a missing "
                    "CheckpointConfig.safe_globals entry; for a new training, give another root)"
                )
            if not failed:
                break
            reason = f"load failed: {error or 'on another rank'}"
            logger.warning("ettr: checkpoint %s %s; trying an older one", step_dir_name(chosen), reason)
            if self.rank == 0:
                set_aside(self.storage, step_dir_name(chosen), reason, recorder=self._rec)
            self._coord.barrier()
            if step is not None:
                raise CheckpointError(f"checkpoint step {step} in {self.storage.url}: {reason}")
            at_most = chosen - 1
        self._tier_base = Binding(step=chosen, manifest_sha256=digest, world_size=self.world_size)
        self._resumed(chosen, "storage", scanning_begin)
        return chosen

    def _resumed(self, step: int, source: str, begin_ts: float, *, storage_step: int | None = None) -> None:
        """Book a restore of `step`; `storage_step`: the newest storage commit, where `step` is a memory-tier
        commit newer than it (`last_committed_step` stays storage's: a save of `step` must still write it)."""
        where = self.storage.path(step_dir_name(step)) if source == "storage" else source
        if storage_step is not None:
            where = f"{source} (a memory-tier commit; storage has step {storage_step})"
        logger.info("ettr: restored step %d from %s in %.2f s", step, where, time.time() - begin_ts)
        self.restored_from = source
        self.restored_tier = "memory" if storage_step is not None else None
        self.last_committed_step = step if storage_step is None else storage_step
        self.policy.reset(self._clock())
        if self._tier_policy is not None:
            self._tier_policy.reset(self._clock())
        self._rec.resumed_from(step)

    def _restore_from_memory(self, step: int | None) -> int | None:
        """Load the newest committed checkpoint (or exactly `step`) from every rank's memory copy; None when
        any rank has none that checks out (then every rank reads storage). Without `step`, a memory-tier
        commit newer than storage's newest comes first (`_restore_from_tier`). Rank 0 draws this process
        lifetime's lineage token here, with its decision. Collective."""
        assert self.memory is not None
        decision: list[Any] = [None, "", [], ""]
        if self.rank == 0:
            decision = [*self._newest_commit(step), secrets.token_hex(16)]
        decision = self._coord.broadcast_from_0(decision)
        self._lineage = decision[3]
        if decision[0] is None:
            return None
        binding = Binding(step=decision[0], manifest_sha256=decision[1], world_size=self.world_size)
        if self.config.memory_interval is not None and step is None:  # the config: the same on every rank
            tiered = self._restore_from_tier(binding)
            if tiered is not None:
                self._existing_steps = set(decision[2])
                self._warned_earlier_run = True
                self._memory_source = "memory"
                self._tier_base = binding
                return tiered
        found = self.memory.find(binding)
        source = "memory"
        if self._peers is not None:
            received = fetch(
                self._peers, self.memory, binding, found.snapshot is not None, self._coord.process_group
            )
            if received is not None:
                found, source = Found(snapshot=received), "peer"
        if self._coord.agree(found.snapshot is None)[0]:
            if found.snapshot is None:
                # Said, and booked: a restart on a surviving node that reads storage is slower than it
                # should be, and the books must tell a stale or missing copy from a broken restore.
                self._memory_not_used = f"rank {self.rank}: {found.reason}"
                logger.warning("ettr: rank %d: %s; restoring from storage", self.rank, found.reason)
            else:
                self._memory_not_used = f"another rank had no usable copy of step {binding.step}"
                found.snapshot.close()
            return None
        assert found.snapshot is not None
        tier_why = {"tier_not_used": self._tier_not_used[:300]} if self._tier_not_used else {}
        error = self._load_snapshot(found.snapshot, binding.step, source=source, **tier_why)
        if self._coord.agree(bool(error))[0]:
            self._memory_not_used = f"restore from memory failed: {error or 'on another rank'}"
            logger.warning(
                "ettr: restore from memory failed (%s); restoring from storage", error or "on another rank"
            )
            return None
        self._existing_steps = set(decision[2])
        self._warned_earlier_run = True
        self._memory_source = source
        self._tier_base = binding
        return binding.step

    def _restore_from_tier(self, newest: Binding) -> int | None:
        """Load the memory-tier commit every rank holds, newer than the storage commit `newest` (the newest
        in storage, as rank 0 admitted it); None when any rank holds none, or the ranks' copies are not of the
        same (step, lineage) — the cross-rank agreement on the newest step every rank holds: one all-gather —
        or any rank fails to load its copy (then the storage-tier paths run, and load the whole state again).
        Collective."""
        no_tier = Found(snapshot=None, reason="no memory tier here")
        found = self._tier.find(newest=newest) if self._tier is not None else no_tier
        keys = self._coord.all_gather(found.key)
        if keys[0] is None or any(key != keys[0] for key in keys):
            if found.snapshot is not None:
                found.snapshot.close()
            if any(key is not None for key in keys):  # some rank had one: say why it was not used
                held = sorted({key[0] for key in keys if key is not None})
                self._tier_not_used = (
                    f"rank {self.rank}: {found.reason}"
                    if found.snapshot is None
                    else f"the ranks' memory-tier copies differ (steps {held})"
                )
                logger.info("ettr: memory-tier commit not used (%s)", self._tier_not_used)
            return None
        assert found.snapshot is not None
        step = keys[0][0]
        error = self._load_snapshot(
            found.snapshot, step, source="memory", tier="memory", storage_step=newest.step
        )
        if self._coord.agree(bool(error))[0]:
            self._tier_not_used = f"restore from the memory tier failed: {error or 'on another rank'}"
            logger.warning("ettr: %s; restoring the storage commit", self._tier_not_used)
            return None
        return step

    def _load_snapshot(self, found: Snapshot, step: int, **phase_data: Any) -> str:
        """Load `found` (a memory copy whose header checked out) into the live state, recorded as RESTORE with
        `phase_data`; closes it. Returns what went wrong ("": it holds step `step` and loaded)."""
        error = ""
        with self._rec.phase(Phase.RESTORE, step=step, **phase_data):
            try:
                loaded = found.load()
                target = self.state.load_target(set(loaded))
                fill(target, loaded)
                del loaded
                loaded_step = self.state.load(target, allowed=self.config.safe_globals)
                if loaded_step != step:
                    error = f"the memory copy holds the state of step {loaded_step}, not {step}"
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - any failure falls back to storage
                error = describe_error(exc)
            finally:
                found.close()
        return error

    def _newest_commit(self, step: int | None) -> list[Any]:
        """[step, manifest digest, every step under the root] of the newest committed checkpoint (or of
        `step`) whose manifest verifies and is admitted (`admission`: the same checks as a restore from
        storage, less the data files' CRC-32s, which the memory copy does not need); [None, "", []] when
        there is none (the storage path then deals with what is there)."""
        checkpoints = list_checkpoints(self.storage)
        committed = [c for c in checkpoints if c.has_manifest and (step is None or c.step == step)]
        if not committed:
            return [None, "", []]
        newest = committed[-1]
        try:
            manifest = verify(self.storage, newest.name, checksums=False, admit=self._admission())
        except (CheckpointError, OSError):
            return [None, "", []]
        return [newest.step, manifest.digest, [c.step for c in checkpoints]]

    def _load(self, chosen: int, digest: str, *, authenticated: bool) -> tuple[str, bool]:
        """Load checkpoint `chosen` (the one whose manifest rank 0 admitted: `digest`) into the state;
        returns ("", False) or what went wrong, and whether that is fatal: a pickled part refused by
        `weights_only` in an authenticated checkpoint is the job's own type missing from
        `CheckpointConfig.safe_globals`, not a reason to fall back (never raises otherwise)."""
        name = step_dir_name(chosen)
        allowed = self.config.safe_globals

        def admitted(manifest: Manifest) -> None:
            if manifest.digest != digest:
                raise CheckpointInvalid(f"the manifest of {name} changed after it was chosen")

        try:
            why = {"memory_not_used": self._memory_not_used[:300]} if self._memory_not_used else {}
            if self._tier_not_used:  # a memory-tier commit some rank held was not used (`_restore_from_tier`)
                why["tier_not_used"] = self._tier_not_used[:300]
            with self._rec.phase(Phase.RESTORE, step=chosen, source="storage", **why):
                with lease(self.storage, name) if self.rank == 0 else contextlib.nullcontext():
                    manifest = retry_transient(
                        lambda: verify(self.storage, name, checksums=False, admit=admitted),
                        what=f"reading {name}",
                    )
                    reader = verified_reader(self.storage, name, manifest)
                    target = self.state.load_target(saved_top_level_keys(reader.read_metadata()))

                    def load() -> int:
                        dcp.load(
                            target,
                            storage_reader=verified_reader(self.storage, name, manifest),
                            planner=SafeLoadPlanner(allowed=allowed),
                            process_group=self._coord.process_group,
                            no_dist=not self._coord.distributed,
                        )
                        return self.state.load(target, allowed=allowed)

                    loaded_step = retry_transient(load, what=f"loading {name}")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure to load (DCP's CheckpointException is a
            # BaseException) falls back to an older checkpoint, unless it is the job's own: a refused pickled
            # part (`safe_globals`) or a state that no longer matches (a changed model: every older one would
            # fail the same, and moving them all aside loses them to the job run again with the right model).
            refused = _unsafe_pickle_in(exc) or _state_mismatch_in(exc)
            return describe_error(refused or exc), refused is not None and authenticated
        if loaded_step != chosen:
            return f"{name} holds the state of step {loaded_step}, not {chosen}", False
        return "", False

    def _admission(self) -> Admission:
        return Admission(
            ring=self._ring,
            root=self._root,
            allow_unsigned=self.config.allow_unsigned or env_flag(ALLOW_UNSIGNED_ENV),
            resume_foreign=self.config.resume_foreign or env_flag(RESUME_FOREIGN_ENV),
        )

    def _choose_checkpoint(
        self, step: int | None, at_most: int | None
    ) -> tuple[int | None, list[int], str, bool]:
        """Rank 0 picks the checkpoint and cleans what cannot be used; every rank learns the result:
        (step, existing steps, the admitted manifest's digest, whether it was authenticated)."""
        result: list[Any] = [None, [], "", False]
        if self.rank == 0:
            choice = choose_checkpoint(
                self.storage,
                recorder=self._rec,
                step=step,
                at_most=at_most,
                checksums=self.config.verify_checksums,
                admit=self._admission(),
            )
            result = [
                choice.step,
                list(choice.existing_steps),
                choice.manifest.digest if choice.manifest is not None else "",
                bool(choice.verdict is not None and choice.verdict.authenticated),
            ]
            self._refused_steps.update(choice.refused_steps)  # rank 0 deletes (retention, making room)
        result = self._coord.broadcast_from_0(result)
        return result[0], result[1], result[2], result[3]

    # -- preemption and shutdown ------------------------------------------------------------------------


def _chain(exc: BaseException) -> list[BaseException]:
    """A failed load's exceptions: itself, DCP's per-rank failures and their causes (at most 32)."""
    seen: list[BaseException] = [exc]
    index = 0
    while index < len(seen) and index < 32:
        current = seen[index]
        index += 1
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            seen.extend(w[0] if isinstance(w, tuple) else w for w in failures.values() if w is not None)
        for linked in (current.__cause__, current.__context__):
            if isinstance(linked, BaseException):
                seen.append(linked)
    return seen[:32]


def _unsafe_pickle_in(exc: BaseException) -> UnsafePickle | None:
    """The UnsafePickle behind a failed load (DCP wraps it in a CheckpointException per rank), if any."""
    return next((e for e in _chain(exc) if isinstance(e, UnsafePickle)), None)


_MISMATCH_MESSAGES = ("Size mismatch between saved", "Missing key in checkpoint state_dict")
"""DCP's load planner's words for a state that is not the one saved (read from the checked `.metadata`, never
from data: no corruption says them)."""


def _state_mismatch_in(exc: BaseException) -> BaseException | None:
    """The error behind a failed load saying the live state does not match the saved one (a model that
    changed shape or gained a parameter), if any."""
    return next((e for e in _chain(exc) if any(m in str(e) for m in _MISMATCH_MESSAGES)), None)

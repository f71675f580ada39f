"""The init communication audit on a fake `torch.distributed` namespace: attribution, nesting, end, safety."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ettr.audit import MARK_NAME, UNPHASED, AuditConfig, CommAudit
from ettr.events import Event, EventKind, Phase
from ettr.ledger import MemoryLedger
from ettr.recorder import NullRecorder, Recorder
from ettr.report.audit import audit_events, render


class FakeClock:
    """Each reading advances by `tick_s`: a call's duration is a known number of ticks."""

    def __init__(self, tick_s: float = 1.0) -> None:
        self.now = 0.0
        self.tick_s = tick_s

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


def fake_dist() -> SimpleNamespace:
    """A namespace shaped like torch.distributed, whose helpers call each other through it (like c10d)."""
    ns = SimpleNamespace(log=[])

    def all_reduce(tensor, group=None):
        ns.log.append("all_reduce")
        return tensor

    def all_gather(out, tensor, group=None):
        ns.log.append("all_gather")

    def all_gather_object(out, obj, group=None):
        ns.all_gather(out, obj)  # resolved through the namespace, as c10d resolves its globals
        ns.log.append("all_gather_object")

    def new_group(ranks=None):
        ns.log.append("new_group")
        return ("group", tuple(ranks or ()))

    def new_subgroups(size):
        return [ns.new_group([i]) for i in range(size)]

    def barrier(group=None):
        raise RuntimeError("peer went away")

    ns.all_reduce, ns.all_gather, ns.all_gather_object = all_reduce, all_gather, all_gather_object
    ns.new_group, ns.new_subgroups, ns.barrier = new_group, new_subgroups, barrier
    ns.get_rank = lambda: 0  # not audited
    return ns


def make(recorder=None, **kwargs):
    ns = fake_dist()
    rec = recorder if recorder is not None else Recorder(MemoryLedger(), rank=3, flush_interval_s=60)
    audit = CommAudit(rec, targets=[ns], clock=FakeClock(), wall_clock=lambda: 1000.0, **kwargs)
    return ns, rec, audit


def marks(rec: Recorder) -> list[Event]:
    rec.flush()
    return audit_events(rec._ledger.read())


def test_calls_are_attributed_to_the_innermost_open_phase():
    ns, rec, audit = make()
    audit.install()
    ns.all_reduce(1)
    with rec.phase(Phase.PROCESS_GROUP_INIT):
        ns.new_group([0, 1])
        with rec.phase(Phase.RESTORE):
            ns.all_reduce(2)
        ns.all_reduce(3)
    summary = audit.finish()
    stages = summary["stages"]
    assert stages[UNPHASED] == {"all_reduce": {"num_calls": 1, "total_s": 1.0, "max_s": 1.0}}
    assert stages["process_group_init"]["new_group"]["num_calls"] == 1
    assert stages["process_group_init"]["all_reduce"]["num_calls"] == 1
    assert stages["restore"]["all_reduce"]["num_calls"] == 1
    assert summary["num_calls"] == 4 and summary["num_groups_created"] == 1
    assert summary["total_s"] == pytest.approx(4.0)  # one tick per call
    assert [c[:2] for c in summary["calls"]] == [
        [UNPHASED, "all_reduce"],
        ["process_group_init", "new_group"],
        ["restore", "all_reduce"],
        ["process_group_init", "all_reduce"],
    ]
    assert ns.log == ["all_reduce", "new_group", "all_reduce", "all_reduce"]  # each ran exactly once


def test_nested_calls_are_counted_once_but_nested_group_creation_still_counts():
    ns, rec, audit = make()
    audit.install()
    with rec.phase(Phase.TRAIN_MODULE_CREATION):
        ns.all_gather_object([None], {"plan": 1})
        ns.new_subgroups(3)
    summary = audit.finish()
    ops = summary["stages"]["train_module_creation"]
    assert set(ops) == {"all_gather_object", "new_subgroups"}  # not the inner all_gather / new_group
    assert ops["all_gather_object"]["num_calls"] == 1
    assert summary["num_groups_created"] == 3
    assert ns.log == ["all_gather", "all_gather_object", "new_group", "new_group", "new_group"]


def test_training_start_ends_the_audit_restores_the_originals_and_records_one_mark():
    ns, rec, audit = make()
    original = ns.all_reduce
    audit.install()
    assert ns.all_reduce is not original and audit.active
    with rec.phase(Phase.PRE_TRAIN):
        ns.all_reduce(1)
    rec.training_started()
    assert not audit.active
    assert ns.all_reduce is original  # nothing of the audit left in the loop
    assert "record" not in vars(rec)  # the recorder's own method again
    ns.all_reduce(2)
    rec.step(1)
    (mark,) = marks(rec)
    assert mark.rank == 3
    assert mark.data["name"] == MARK_NAME and mark.data["num_calls"] == 1
    assert audit.finish() == audit.summary()  # idempotent


def test_the_first_step_ends_the_audit_when_training_start_is_not_called():
    ns, rec, audit = make()
    audit.install()
    ns.all_reduce(1)
    rec.step(1)
    assert not audit.active and len(marks(rec)) == 1


def test_an_error_of_the_call_reaches_the_caller_and_is_counted():
    ns, rec, audit = make()
    audit.install()
    with pytest.raises(RuntimeError, match="peer went away"):
        ns.barrier()
    ns.all_reduce(1)  # the depth guard was reset by the failure
    stats = audit.finish()["stages"][UNPHASED]
    assert stats["barrier"]["num_errors"] == 1 and stats["all_reduce"]["num_calls"] == 1


def test_a_broken_clock_never_breaks_the_call(caplog):
    ns = fake_dist()

    def broken_clock() -> float:
        raise OSError("no clock")

    audit = CommAudit(None, targets=[ns], clock=broken_clock).install()
    with caplog.at_level(logging.WARNING, logger="ettr"):
        assert ns.all_reduce(7) == 7
        assert ns.all_reduce(8) == 8
    assert ns.log == ["all_reduce", "all_reduce"]
    assert sum("init comm audit" in r.message for r in caplog.records) == 1  # logged once
    audit.finish()


def test_a_wrapper_installed_after_the_audit_is_left_in_place():
    ns, rec, audit = make()
    audit.install()
    audited = ns.all_reduce

    def theirs(tensor, group=None):
        return audited(tensor, group)

    ns.all_reduce = theirs
    audit.finish()
    assert ns.all_reduce is theirs
    assert ns.all_reduce(5) == 5  # ours passes straight through now
    assert audit.summary()["num_calls"] == 0


def test_max_calls_kept_bounds_the_call_list_not_the_counts():
    ns, rec, audit = make(config=AuditConfig(max_calls_kept=2))
    audit.install()
    for i in range(5):
        ns.all_reduce(i)
    summary = audit.finish()
    assert summary["num_calls"] == 5 and len(summary["calls"]) == 2 and summary["num_calls_dropped"] == 3


def test_without_a_ledger_it_still_counts_and_attributes():
    ns, rec, audit = make(recorder=NullRecorder())
    audit.install()
    with rec.phase(Phase.DEVICE_INIT):
        ns.all_reduce(1)
    assert audit.finish()["stages"]["device_init"]["all_reduce"]["num_calls"] == 1


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_calls_kept"):
        AuditConfig(max_calls_kept=-1)
    with pytest.raises(ValueError, match="ops"):
        AuditConfig(ops=())


def _mark(rank: int, stages: dict, attempt: int = 0) -> Event:
    num_calls = sum(s["num_calls"] for ops in stages.values() for s in ops.values())
    total_s = sum(s["total_s"] for ops in stages.values() for s in ops.values())
    data = {
        "name": MARK_NAME,
        "num_calls": num_calls,
        "total_s": total_s,
        "num_groups_created": 1,
        "stages": stages,
    }
    return Event(EventKind.MARK, 100.0, attempt=attempt, rank=rank, data=data)


def test_render_shows_the_slowest_rank_per_row_and_per_rank_totals():
    op = lambda n, t: {"num_calls": n, "total_s": t, "max_s": t / n}  # noqa: E731
    events = [
        Event(EventKind.PHASE_END, 12.0, rank=0, phase=Phase.TRAIN_MODULE_CREATION, value=10.0),
        Event(EventKind.PHASE_END, 13.0, rank=1, phase=Phase.TRAIN_MODULE_CREATION, value=10.0),
        _mark(0, {"process_group_init": {"init_process_group": op(1, 0.5)},
                  "train_module_creation": {"broadcast_object_list": op(2, 0.2)}}),
        _mark(1, {"process_group_init": {"init_process_group": op(1, 0.25)},
                  "train_module_creation": {"broadcast_object_list": op(2, 0.4)}}),
        Event(EventKind.MARK, 100.0, data={"name": "something_else"}),
    ]  # fmt: skip
    text = render(events)
    lines = text.splitlines()
    assert "attempt 0, 2 rank(s)" in lines[0]
    row = next(line for line in lines if "init_process_group" in line)
    assert row.split()[-3:] == ["1", "500.0", "500.0"]  # rank 0 was slower here
    row = next(line for line in lines if "broadcast_object_list" in line)
    assert row.split()[-3:] == ["2", "400.0", "200.0"]  # rank 1 there
    stage_row = next(line for line in lines if line.strip().startswith("train_module_creation"))
    assert "of 3000 ms in the phase" in stage_row  # the longer rank's phase
    assert any(line.strip().startswith("rank 0: 3 calls, 700.0 ms") for line in lines)
    assert any(line.strip().startswith("rank 1: 3 calls, 650.0 ms") for line in lines)


def test_render_separates_attempts_and_is_empty_without_an_audit():
    assert render([Event(EventKind.STEP, 1.0, step=1)]) == ""
    op = {"barrier": {"num_calls": 1, "total_s": 0.001, "max_s": 0.001}}
    text = render([_mark(0, {"pre_train": op}, attempt=0), _mark(0, {"pre_train": op}, attempt=1)])
    assert "attempt 0" in text and "attempt 1" in text


def test_a_forged_audit_mark_is_shown_escaped_and_never_raises():
    """The marks come from the ledger, which a damaged or forged row may fill: a string count, a list of
    stages or an op that is a number raised out of `ettr report` (ValueError, AttributeError), and stage and
    op names were printed raw (an OSC 52 sequence wrote the terminal's clipboard)."""
    good = {"num_calls": 3, "total_s": 0.5, "max_s": 0.2}
    marks = [
        Event(EventKind.MARK, 100.0, rank=r, data={"name": MARK_NAME, **data})
        for r, data in enumerate(
            [
                {"stages": {"init": {"all_reduce": {"num_calls": "x", "total_s": 1e400}}}, "num_calls": "z"},
                {"stages": {"init": [1, 2]}, "total_s": -1.0},
                {"stages": [1], "num_calls": True},
                {"stages": {"init": {"op": 5}}},
                {"stages": {"in\x1b[2Jit": {"o\x1b]52;c;x\x07p": good}}, "num_calls": 3, "total_s": 0.5},
            ]
        )
    ]
    text = render(marks)
    assert "\x1b" not in text and "\x07" not in text
    assert "in\\x1b[2Jit" in text and "o\\x1b]52;c;x\\x07p" in text
    assert "all_reduce" not in text  # a row of numbers that are not numbers is not shown as zeros
    assert "rank 0: ? calls" in text and "rank 1: 0 calls, ? ms" in text and "rank 2: ? calls" in text
    assert "rank 4: 3 calls, 500.0 ms" in text

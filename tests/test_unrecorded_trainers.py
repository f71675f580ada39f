"""Processes a script starts itself that step an optimizer without becoming ranks (pytorch/examples'
`mnist_hogwild`): they are named, on the console and in the report, and the job's ETT stays unknown
(`ettr.bootstrap.unrecorded`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from ettr.accounting import compute
from ettr.bootstrap import unrecorded
from ettr.constants import UNRECORDED_MARK
from ettr.events import SUPERVISOR_RANK, Event, EventKind
from ettr.report.hints import no_step_hints
from ettr.run_env import ATTEMPT_ENV, INSTRUMENTED_ENV, RUN_DIR_ENV, unrecorded_trainers

ROOT = Path(__file__).resolve().parents[1]


class _Optim:
    """`torch.optim.optimizer`'s global post-step hooks, in memory, called as torch calls them: iterating the
    registry itself (a hook that removed itself raised "OrderedDict mutated during iteration" in every rank)."""

    def __init__(self) -> None:
        self.hooks: OrderedDict[int, Any] = OrderedDict()

    def register_optimizer_step_post_hook(self, hook: Any) -> Any:
        key = len(self.hooks)
        self.hooks[key] = hook
        return type("Handle", (), {"remove": lambda _: self.hooks.pop(key, None)})()

    def step(self) -> None:
        for hook in self.hooks.values():
            hook(object(), (), {})


@pytest.mark.parametrize(("marker", "noted"), [("1", True), ("own", False), (None, False)])
def test_the_first_step_of_a_process_that_is_no_rank_is_noted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: str | None, noted: bool
) -> None:
    # marker "1": it carries its spawner's marker (pid 1), so it is no rank; "own": a rank (or the
    # instrumented process); None: not under the instrumented process at all.
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(ATTEMPT_ENV, "2")
    if marker is None:
        monkeypatch.delenv(INSTRUMENTED_ENV, raising=False)
    else:
        monkeypatch.setenv(INSTRUMENTED_ENV, str(os.getpid()) if marker == "own" else marker)
    monkeypatch.setattr(unrecorded, "_handles", [])
    monkeypatch.setattr(unrecorded, "_noted", [])
    optim = _Optim()
    optim.register_optimizer_step_post_hook(lambda *_: None)  # ettr's own step hook, as in a rank
    unrecorded.watch_steps(optim)  # type: ignore[arg-type]
    optim.register_optimizer_step_post_hook(lambda *_: None)
    for _ in range(3):
        optim.step()  # the registry is never changed while torch iterates it
    assert unrecorded_trainers(tmp_path, 2) == ([os.getpid()] if noted else [])


def test_the_report_says_why_ett_is_unknown_when_processes_trained_unrecorded() -> None:
    events = [
        Event(EventKind.SUPERVISOR_START, 100.0, rank=SUPERVISOR_RANK, data={"launcher": "python"}),
        Event(EventKind.ATTEMPT_START, 100.0, rank=SUPERVISOR_RANK),
        Event(EventKind.PROCESS_START, 101.0, rank=0),
        Event(EventKind.MARK, 150.0, rank=0, data={"name": UNRECORDED_MARK, "pids": [42, 43, "x"]}),
        Event(
            EventKind.ATTEMPT_END, 151.0, rank=SUPERVISOR_RANK, data={"outcome": "completed", "exit_code": 0}
        ),
        Event(EventKind.JOB_END, 151.0, rank=SUPERVISOR_RANK, data={"exit_status": 0}),
    ]
    report = compute(events, now=200.0)
    assert (
        report.ett_unknown is not None
        and "processes 42, 43, started by the script itself" in report.ett_unknown
    )
    (hint,) = no_step_hints(events, report)
    assert (
        "processes 42, 43, started by the script itself, stepped an optimizer without joining a process group"
        in hint
    )
    assert "never stepped" not in hint


HOGWILD = textwrap.dedent(
    """
    import torch, torch.multiprocessing as mp

    def train(rank, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(20):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()

    if __name__ == "__main__":
        mp.set_start_method("spawn", force=True)
        model = torch.nn.Linear(4, 2)
        model.share_memory()
        ps = [mp.Process(target=train, args=(r, model)) for r in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        assert all(p.exitcode == 0 for p in ps)
    """
)


@pytest.mark.slow
def test_a_hogwild_job_under_ettr_run_names_its_unrecorded_processes(tmp_path: Path) -> None:
    (tmp_path / "hogwild.py").write_text(HOGWILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ETTR_STANDBY": "0"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(run_dir), "--", sys.executable, "hogwild.py"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "report", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "ETT unknown" in report.stdout
    note = report.stdout + report.stderr
    assert "stepped an optimizer without joining a process group" in note, note
    as_json = subprocess.run(
        [sys.executable, "-m", "ettr.cli", "report", "--json", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "stepped an optimizer without joining a process group" in json.loads(as_json.stdout)["ett_unknown"]

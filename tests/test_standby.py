"""Warm standby (`ettr.supervisor.standby`, `ettr.bootstrap.standby`) with real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ettr.events import EventKind
from ettr.ledger import read_run_events
from ettr.supervisor.standby import STANDBY_FALLBACK_S, Standby
from ettr.warn import STDERR_TEE_ENV

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "scripts" / "standby_probe.py"


def run_ettr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ettr.cli", *args], env=full, capture_output=True, text=True, timeout=300
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_restart_runs_in_the_standby_with_the_new_attempts_environment(tmp_path: Path) -> None:
    out = tmp_path / "probe.jsonl"
    done = run_ettr(
        "run", "--run-dir", str(tmp_path / "run"), "--max-restarts", "1", "--",
        sys.executable, str(PROBE), str(out), "x",
        env={"PROBE": "same"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second = lines(out)
    assert (first["attempt"], second["attempt"]) == ("0", "1")  # the hand-over's environment, not a stale one
    assert second["argv"] == [str(PROBE), str(out), "x"] and second["name"] == "__main__"
    assert second["path0"] == str(PROBE.parent) and second["probe"] == "same"
    # The installed packages attempt 0 had imported by its first step were imported ahead in the standby.
    assert (first["preloaded"], second["preloaded"]) == (False, True)
    # It warmed up at idle priority (as root here) and trains at the normal one, as a cold start does.
    assert second["policy"] == first["policy"] == os.SCHED_OTHER
    events = read_run_events(tmp_path / "run")
    marks = [e for e in events if e.kind is EventKind.MARK and (e.data or {}).get("name") == "standby"]
    assert [m.attempt for m in marks] == [1] and marks[0].data["pid"] == second["pid"]
    starts = {e.attempt: e.ts for e in events if e.kind is EventKind.PROCESS_START}
    attempt_start = next(e.ts for e in events if e.kind is EventKind.ATTEMPT_START and e.attempt == 1)
    assert starts[1] >= attempt_start  # the process of attempt 1 starts at the hand-over


def test_the_standby_starts_only_once_the_attempt_has_trained(tmp_path: Path) -> None:
    # Started during the attempt's start-up, it would compete with it for the CPU.
    out = tmp_path / "probe.jsonl"
    done = run_ettr(
        "run", "--run-dir", str(tmp_path / "run"), "--max-restarts", "1", "--",
        sys.executable, str(PROBE), str(out),
        env={"PROBE_BEFORE_S": "4"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = read_run_events(tmp_path / "run")
    first_step = min(e.ts for e in events if e.kind is EventKind.STEP and e.attempt == 0)
    attempt_start = next(e.ts for e in events if e.kind is EventKind.ATTEMPT_START and e.attempt == 0)
    mark = next(e for e in events if e.kind is EventKind.MARK and (e.data or {}).get("name") == "standby")
    assert first_step - attempt_start > 4  # the start-up was longer than STANDBY_AFTER_S
    # Not before the first step -- unless the start-up outlasted the fallback delay (a heavily loaded machine)
    spawned_at = mark.data["spawned_at"]
    assert spawned_at >= first_step or spawned_at - attempt_start >= STANDBY_FALLBACK_S


def test_a_standby_is_due_after_the_first_step_or_the_fallback_delay() -> None:
    from ettr.supervisor import standby

    def never() -> bool:
        raise AssertionError("asked before STANDBY_AFTER_S")

    assert not standby.due(0.5, never)
    assert not standby.due(standby.STANDBY_AFTER_S + 1, lambda: False)
    assert standby.due(standby.STANDBY_AFTER_S + 1, lambda: True)
    assert standby.due(standby.STANDBY_FALLBACK_S, lambda: False)


def _may_leave_idle() -> bool:
    """Whether a process here may go to SCHED_IDLE and back (what the standby tries before idling)."""
    import threading

    result: list[bool] = []

    def probe() -> None:  # on a thread of its own: the test's thread keeps its scheduling whatever happens
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return result == [True]


def test_a_standby_is_discarded_when_the_environment_differs(tmp_path: Path) -> None:
    import time

    argv = [sys.executable, str(PROBE), str(tmp_path / "p.jsonl")]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ETTR_ATTEMPT": "1", "PROBE": "a"}
    ready = Standby.start(argv, env)
    assert ready is not None
    if _may_leave_idle():  # it may return to normal scheduling: it waits at idle priority
        deadline = time.monotonic() + 20
        while os.sched_getscheduler(ready.process.pid) != os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getscheduler(ready.process.pid) == os.SCHED_IDLE
    assert ready.fits(argv, {**env, "ETTR_ATTEMPT": "2"})  # per-attempt names may differ
    assert not ready.fits(argv, {**env, "PROBE": "b"})
    assert not ready.fits([sys.executable, "-u", *argv[1:]], env)
    assert ready.hand_over(argv, {**env, "PROBE": "b"}) is None
    assert ready.process.poll() is not None  # gone: never runs the attempt
    assert not (tmp_path / "p.jsonl").exists()


def test_no_standby_for_torchrun_or_modules(tmp_path: Path) -> None:
    env = dict(os.environ)
    assert Standby.start([sys.executable, "-m", "torch.distributed.run", str(PROBE)], env) is None
    # accelerate's launcher: the script it runs is the rank, never the standby that would run accelerate
    assert Standby.start([sys.executable, "-m", "accelerate.commands.launch", str(PROBE)], env) is None
    assert Standby.start(["torchrun", "--nproc-per-node", "2", str(PROBE)], env) is None
    assert Standby.start([sys.executable, str(tmp_path / "missing.py")], env) is None


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_a_standby_never_sees_a_per_attempt_value_before_its_hand_over(tmp_path: Path) -> None:
    """What the standby's start-up could read is only what the next attempt shares with this one; the
    per-attempt names arrive with the hand-over, and a standby serves one attempt, never a second."""
    out = tmp_path / "p.jsonl"
    argv = [sys.executable, "-u", str(PROBE), str(out)]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "ETTR_ATTEMPT": "1",
        "MASTER_PORT": "1111",
        "PROBE": "a",
    }
    names = frozenset({"MASTER_PORT"})
    ready = Standby.start(argv, env, per_attempt=names)
    assert ready is not None
    started_with = _environ_of(ready.process.pid)
    # ETTR_STDERR_TEE names the process's own stderr pipe (ettr.warn), not anything of an attempt
    attempt_names = [k for k in started_with if k.startswith("ETTR_") and k != STDERR_TEE_ENV]
    assert "MASTER_PORT" not in started_with and not attempt_names
    assert ready.fits(argv, {**env, "MASTER_PORT": "2222", "ETTR_ATTEMPT": "2"})
    assert not ready.fits(argv, {**env, "PROBE": "b"})
    running = ready.hand_over(argv, {**env, "MASTER_PORT": "2222", "ETTR_ATTEMPT": "2"})
    assert running is ready.process
    assert ready.hand_over(argv, {**env, "ETTR_ATTEMPT": "3"}) is None  # used: not handed a second attempt
    assert running.wait(120) == 0  # ... and the first one was left to run to its end
    (seen,) = lines(out)
    assert (seen["attempt"], seen["probe"], seen["argv"]) == ("2", "a", [str(PROBE), str(out)])


def test_the_first_step_marker_names_installed_packages_only(tmp_path: Path, monkeypatch) -> None:
    import site
    import types

    from ettr.bootstrap.start import installed_packages
    from ettr.run_env import trained_modules, trained_path

    installed = os.path.join(site.getsitepackages()[0], "fakepkg", "__init__.py")
    modules = {
        "fakepkg": types.SimpleNamespace(__file__=installed),
        "fakepkg.sub": types.SimpleNamespace(__file__=installed),  # submodules: the package is enough
        "mine": types.SimpleNamespace(__file__=str(tmp_path / "mine.py")),  # the script's own code
        "ettr": types.SimpleNamespace(__file__=installed),  # imported by every standby anyway
        "builtin": types.SimpleNamespace(),
    }
    assert installed_packages(modules) == ["fakepkg"]
    marker = trained_path(tmp_path, 3, 42)
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"modules": ["torchrec", "fbgemm_gpu", "not a name"]}))
    (marker.parent / "trained-pid-43").write_text("torn")
    (marker.parent / "trained-pid-44").write_text("")
    assert trained_modules(tmp_path, 3) == ["fbgemm_gpu", "torchrec"]
    assert trained_modules(tmp_path, 4) == []


def test_the_first_step_marker_names_the_torch_and_ettr_packages_imported() -> None:
    """What a killed rank's replacement would import after the hand-over (the in-place wrapper's
    torch.distributed.optim, the checkpoint manager's ettr.checkpoint, inductor's compile path once the
    attempt compiled) is imported by its standby."""
    import types

    from ettr.bootstrap.start import imported_parts

    package = types.SimpleNamespace(__path__=["x"])
    modules = {
        "torch": package,  # imported by every standby anyway
        "torch.distributed.optim": package,
        "torch._dynamo": package,  # private, but one of TORCH_PARTS
        "torch._inductor": package,  # private: left to the attempt
        "torch._inductor.compile_fx": types.SimpleNamespace(),  # a module, but one of TORCH_PARTS
        "torch._inductor.codecache": types.SimpleNamespace(),  # private: imported with compile_fx anyway
        "torch.distributed.optim.zero_redundancy_optimizer": types.SimpleNamespace(),  # its package's
        "ettr.checkpoint": package,
        "torchrec.distributed": package,  # an installed package's part: the package is named instead
    }
    assert imported_parts(modules) == [
        "ettr.checkpoint",
        "torch._dynamo",
        "torch._inductor.compile_fx",
        "torch.distributed.optim",
    ]


def test_the_first_step_marker_names_the_isa_probe_once_inductor_ran_it() -> None:
    """A process whose inductor probed the CPU's vector ISA names the probe, so that its standbys run it
    ahead (spelled the same in the standby, which imports nothing of ettr before its warm-up)."""
    import functools
    import types

    from ettr.bootstrap import standby
    from ettr.bootstrap.start import VEC_ISA_PROBE, imported_parts

    assert standby.VEC_ISA_PROBE == VEC_ISA_PROBE

    def isa_module(probed: bool) -> types.SimpleNamespace:
        probe = functools.cache(lambda: ["avx2"])
        if probed:
            probe()
        return types.SimpleNamespace(valid_vec_isa_list=probe)

    assert imported_parts({VEC_ISA_PROBE: isa_module(True)}) == [VEC_ISA_PROBE]
    assert imported_parts({VEC_ISA_PROBE: isa_module(False)}) == []
    assert imported_parts({VEC_ISA_PROBE: types.SimpleNamespace()}) == []  # inductor changed: no probe named


# What a script or module sees of how it was started, and whether it finds a file beside itself after a chdir.
_SEEN = """
import json, os, sys
seen = {
    "file": __file__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
    "code_file": sys._getframe().f_code.co_filename, "loader": getattr(__loader__, "path", None),
    "cached": globals().get("__cached__"), "package": __package__, "spec": getattr(__spec__, "origin", None),
    "main": sys.modules["__main__"].__dict__ is globals(), "standby_globals": "_warm_up" in globals(),
}
here = os.path.dirname(__file__)
os.chdir("/")
with open(os.path.join(here, "beside.txt")) as f:
    seen["beside"] = f.read()
with open(os.environ["SEEN_OUT"], "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.parametrize(
    "form",
    [
        ["code/train.py", "--x", "1"],
        ["./code/../code/train.py"],
        ["link.py"],
        ["-m", "train"],
        ["-m", "pkg.mod"],
    ],
)
def test_the_standby_runs_the_attempt_as_a_cold_start_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: list[str]
) -> None:
    """The same absolute `__file__`, `sys.argv`, working directory and `sys.path[0]` as `python ...`: a script
    that changes directory and reads a file beside itself works in both (it failed on every warm restart)."""
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    for where in (code / "train.py", code / "pkg" / "mod.py"):
        where.write_text(_SEEN)
        (where.parent / "beside.txt").write_text("found")
    (code / "pkg" / "__init__.py").write_text("")
    (tmp_path / "link.py").symlink_to(code / "train.py")
    (tmp_path / "beside.txt").write_text("found")  # beside the link: where its __file__ says it is
    monkeypatch.chdir(code if form[0] == "-m" else tmp_path)
    argv = [sys.executable, *form]
    out = tmp_path / "seen.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SEEN_OUT": str(out)}
    env.pop("ETTR_RUN_DIR", None)
    subprocess.run(argv, env=env, check=True, timeout=120)
    cold = json.loads(out.read_text())
    out.unlink()
    ready = Standby.start(argv, env)
    assert ready is not None
    running = ready.hand_over(argv, env)
    assert running is not None and running.wait(120) == 0
    running.finish()
    warm = json.loads(out.read_text())
    assert warm == cold
    assert cold["beside"] == "found" and os.path.isabs(cold["file"]) and cold["main"]
    assert not warm["standby_globals"]  # a fresh __main__, not the standby's own module


def test_a_script_that_fails_in_a_standby_prints_the_traceback_of_a_cold_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fail.py").write_text("def inner():\n    raise ValueError('boom')\n\n\ninner()\n")
    monkeypatch.chdir(tmp_path)
    argv = [sys.executable, "fail.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("ETTR_RUN_DIR", None)
    cold = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    ready = Standby.start(argv, env)
    assert ready is not None
    running = ready.hand_over(argv, env)
    assert running is not None
    status = running.wait(120)
    running.finish()
    assert status == cold.returncode == 1
    assert running.stderr_tail() == cold.stderr.splitlines()[-20:]  # no frame of ettr's own


def test_a_forged_first_step_marker_never_names_a_module_the_standby_would_run(tmp_path: Path) -> None:
    # Anyone who can write the run directory can write these files; the standby imports what they name.
    from ettr.bootstrap.start import TORCH_PARTS, VEC_ISA_PROBE
    from ettr.run_env import WARM_PRIVATE_PARTS, trained_modules, trained_path

    assert WARM_PRIVATE_PARTS == {p for p in (*TORCH_PARTS, VEC_ISA_PROBE) if "._" in p}
    (tmp_path / "evilmod.py").write_text("raise SystemExit('imported')\n")  # the working directory's
    marker = trained_path(tmp_path, 0, 42)
    marker.parent.mkdir(parents=True)
    forged = ["evilmod", "this", "unittest.__main__", "torch._C", "torch.utils.bottleneck.__main__", "os"]
    marker.write_text(json.dumps({"modules": [*forged, "torch.distributed", "torch._dynamo", "torchrec"]}))
    assert trained_modules(tmp_path, 0) == ["torch._dynamo", "torch.distributed", "torchrec"]
    os.mkfifo(marker.parent / "trained-pid-43")  # would block the supervisor's read for good
    (marker.parent / "trained-pid-44").symlink_to("/dev/zero")
    assert trained_modules(tmp_path, 0) == ["torch._dynamo", "torch.distributed", "torchrec"]


TEMPLATES_LAZY = """\
import sys
from ettr.bootstrap.standby import _warm_up
_warm_up(sys.argv[1:])
import torch._inductor.compile_fx
from torch._inductor.codegen.common import KernelTemplate
from ettr.patcher import ORIGINAL_ATTR
made = KernelTemplate.__dict__["_template_from_string"].__func__
print(getattr(made, ORIGINAL_ATTR, None) is not None)
"""


@pytest.mark.parametrize("modules", [["torch._inductor.compile_fx"], []])
def test_a_warm_up_that_imports_inductors_compile_path_leaves_its_kernel_templates_to_their_first_use(
    modules: list[str],
) -> None:
    # As the attempt's compile session would (ettr.compile.lazy_templates), on a torch without a GPU backend;
    # a warm-up without the compile path leaves inductor alone, as a cold start's import does.
    torch = pytest.importorskip("torch")
    pytest.importorskip("jinja2")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", TEMPLATES_LAZY, *modules], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    gpu_built = torch.backends.cuda.is_built() or bool(getattr(torch.version, "hip", None))
    assert done.stdout.split()[-1] == str(bool(modules) and not gpu_built)


ISA_PROBE_AHEAD = """\
import json, os
from ettr.bootstrap.standby import VEC_ISA_PROBE, _warm_up
_warm_up([VEC_ISA_PROBE])
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
memo = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "ettr-vec-isa.json")
print(json.dumps({"probed": valid_vec_isa_list.cache_info().currsize > 0, "memo": os.path.isfile(memo)}))
"""


def test_a_warm_up_takes_the_isa_probes_remembered_answer_and_leaves_one_where_it_probed(
    tmp_path: Path,
) -> None:
    # The attempt's probe left its answer in inductor's cache directory (`ettr.compile.isa_probe`); a standby
    # or zygote that probes ahead takes it there instead of loading libtorch in six subprocesses again.
    pytest.importorskip("torch")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    seen = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", ISA_PROBE_AHEAD], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        seen.append(json.loads(done.stdout.splitlines()[-1]))
    assert seen == [{"probed": True, "memo": True}, {"probed": False, "memo": True}]


GC_AROUND_WARM_UP = """\
import gc, json, sys
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "json.tool":
            seen.append(gc.isenabled())
        return None
sys.meta_path.insert(0, Spy())
if sys.argv[1] == "off":
    gc.disable()
from ettr.bootstrap.standby import _warm_up
_warm_up(["json.tool"])
print(json.dumps({"during": seen, "after": gc.isenabled()}))
"""


@pytest.mark.parametrize("before", ["on", "off"])
def test_a_warm_up_imports_with_the_cyclic_collector_off_and_leaves_it_as_it_found_it(before: str) -> None:
    # The imports' collections free nothing (their objects live on) and cost ~12% of their CPU; the attempt
    # that runs after the warm-up finds the collector as a cold start would (or as the caller had set it).
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", GC_AROUND_WARM_UP, before],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"during": [False], "after": before == "on"}

"""The agent's zygote (`ettr.supervisor.zygote`, `ettr.bootstrap.zygote`): a forked worker runs its script as a
cold start would, is the agent's own child (exit status, signals), a zygote with threads forks nothing, and an
in-place replacement is forked. Each case runs a small agent in a process of its own (a child subreaper, as
`ettr run` is), not in the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """\
import json, os, random, signal, sys
import numpy
print(json.dumps({
    "sigint": str(signal.getsignal(signal.SIGINT)), "random": random.random(),
    "numpy": float(numpy.random.random()), "hashseed": os.environ.get("PYTHONHASHSEED"),
    "argv": sys.argv, "file": __file__, "cwd": os.getcwd(), "name": __name__, "path0": sys.path[0],
    "rank": os.environ.get("RANK"), "marker": os.environ.get("ZYGOTE_TEST"), "ppid": os.getppid(),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2),
}), flush=True)
print("rank says goodbye", file=sys.stderr)
if sys.argv[2] == "sleep":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""

AGENT_HEAD = """\
import json, os, signal, sys, time
from ettr.procs import set_child_subreaper
from ettr.supervisor.zygote import Zygote
assert set_child_subreaper()
argv = [sys.executable, "-u", "script.py", "0", "b"]
env = dict(os.environ, RANK="0", LOCAL_RANK="0", MASTER_PORT="1")
def say(**kw):
    print("AGENT " + json.dumps(kw), flush=True)
"""


def _agent(tmp_path: Path, body: str, **env: str) -> list[dict]:
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "agent.py").write_text(AGENT_HEAD + textwrap.dedent(body))
    full = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ETTR_")},
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path)]),
        "OMP_NUM_THREADS": "1",
        "ZYGOTE_TEST": "yes",
        **env,
    }
    done = subprocess.run(
        [sys.executable, "agent.py"], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    said = [json.loads(line[6:]) for line in lines if line.startswith("AGENT ")]
    printed = [json.loads(line) for line in lines if line.startswith("{")]
    return said + [{"script": p} for p in printed]


def test_a_forked_worker_runs_its_script_as_a_cold_start_and_is_the_agents_child(tmp_path):
    found = _agent(
        tmp_path,
        """
        z = Zygote.start(argv, env, modules=["torch.distributed"])
        assert not isinstance(z, str), z
        say(warm=z.wait_warm(), zygote=z.process.pid)
        p, why = z.fork([*argv[:3], "3", "b"], dict(env, RANK="1"))
        say(why=why, pid=p.pid, code=p.wait(60), agent=os.getpid())
        p.finish()
        say(tail=p.stderr_tail())
        q, _ = z.fork([*argv[:3], "0", "sleep"], env)
        time.sleep(1.0)
        q.signal_tree(signal.SIGTERM)
        say(signalled=q.wait(60))
        q.finish()
        gone, why = z.fork(argv, dict(env, PATH_EXTRA="changed"))
        say(misfit=why, none=gone is None, serves=z.serves)
        z.discard()
        """,
    )
    said = {k: v for d in found for k, v in d.items() if k != "script"}
    scripts = [d["script"] for d in found if "script" in d]
    assert said["warm"] is True
    assert said["why"].startswith("forked from the zygote")
    assert said["code"] == 3
    assert said["tail"] == ["rank says goodbye"]
    assert said["signalled"] == -15
    assert said["none"] is True and "PATH_EXTRA" in said["misfit"] and said["serves"] is True
    forked = scripts[0]
    cold = subprocess.run(
        [sys.executable, "-u", "script.py", "3", "b"],
        cwd=tmp_path,
        env={**os.environ, "RANK": "1", "ZYGOTE_TEST": "yes"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    cold_seen = json.loads(cold.stdout)
    for key in ("argv", "file", "cwd", "name", "path0", "rank", "marker", "sigint"):
        assert forked[key] == cold_seen[key], key
    assert forked["ppid"] == said["agent"]  # re-parented to the agent: its own child, not the zygote's
    assert forked["fds"] == cold_seen["fds"]  # only the standard ones (and the listing's own)
    # Random state drawn afresh in each child, as in each cold start: not the zygote's copied twice.
    assert scripts[1]["random"] != forked["random"] and scripts[1]["numpy"] != forked["numpy"]


def test_a_zygote_with_threads_forks_nothing_and_the_rank_starts_cold_with_the_reason(tmp_path):
    """A warm-up import that starts a thread (numpy's OpenBLAS pool without OMP_NUM_THREADS=1, a job of one
    local worker) ends the warm-up there: the zygote says why at once, the modules after it are not
    imported, and the agent does not wait for them (before: 1.7 s more of imports, then a cold start)."""
    (tmp_path / "spinner.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    (tmp_path / "after_spinner.py").write_text("open('after_spinner_imported', 'w').close()\n")
    found = _agent(
        tmp_path,
        """
        from ettr.supervisor.standby_group import StandbyGroup
        z = Zygote.start(argv, env, modules=["spinner", "after_spinner"])
        say(warm=z.wait_warm(), broken=z.broken)
        group = StandbyGroup([], z)
        procs, relaunch, _ = group.take([argv], [env])
        say(path=relaunch.path, why=relaunch.why, cold=procs == [None], serves=z.serves, alive=z.process.poll() is None)
        """,
    )
    said = {k: v for d in found for k, v in d.items() if k != "script"}
    assert said["warm"] is False and "threads" in said["broken"], said
    assert not (tmp_path / "after_spinner_imported").exists()  # the warm-up stopped at the thread
    assert said["path"] == "cold" and said["cold"] is True
    assert "zygote not used" in said["why"] and "threads" in said["why"], said["why"]
    assert said["serves"] is False and said["alive"] is False


def test_an_in_place_replacement_is_forked_from_the_zygote(tmp_path):
    found = _agent(
        tmp_path,
        """
        from pathlib import Path
        from ettr.supervisor.relaunch import Relaunch
        from ettr.supervisor.standby_group import StandbyGroup, start_zygote, with_zygote
        z = start_zygote([argv], [env], run_dir=Path("."), attempt=0)
        group = with_zygote(None, z)
        process, how, promoted = group.take_rank(1, argv, dict(env, RANK="1"))
        say(path=how.path, promoted=promoted is None, code=process.wait(60))
        summary = Relaunch.in_place([1], [how])
        say(summary=summary.path, summary_why=summary.why)
        z.discard()
        """,
    )
    said = {k: v for d in found for k, v in d.items() if k != "script"}
    assert said["path"] == "forked" and said["promoted"] is True and said["code"] == 0
    assert said["summary"] == "forked" and said["summary_why"].startswith("in place: rank 1 replaced (forked")


@pytest.mark.parametrize("environ", [{"ETTR_ZYGOTE": "0"}, {"ETTR_STANDBY": "0"}])
def test_the_zygote_is_off_with_its_switch_or_the_standbys(environ):
    from ettr.supervisor import zygote

    assert zygote.enabled({}) is True
    assert zygote.enabled(environ) is False


def test_the_zygote_leaves_out_only_the_per_rank_and_per_attempt_names():
    from ettr.supervisor.zygote import stable_env

    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "MASTER_PORT": "2",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "ETTR_X": "4",
    }
    assert stable_env({**env, "OMP_NUM_THREADS": "1", "ROLE_NAME": "default"}) == {
        "OMP_NUM_THREADS": "1",
        "ROLE_NAME": "default",
    }


TORCH_SCRIPT = """\
import json, multiprocessing, torch
print(json.dumps({"seed": torch.initial_seed(), "authkey": bytes(multiprocessing.current_process().authkey).hex()}))
"""


def test_forked_workers_draw_torchs_seed_and_the_authkey_afresh_as_cold_starts_do(tmp_path):
    (tmp_path / "seeds.py").write_text(TORCH_SCRIPT)
    found = _agent(
        tmp_path,
        """
        argv = [sys.executable, "-u", "seeds.py"]
        z = Zygote.start(argv, env)
        say(warm=z.wait_warm())
        for rank in ("0", "1"):
            p, why = z.fork(argv, dict(env, RANK=rank))
            say(why=why, code=p.wait(60))
            p.finish()
        z.discard()
        """,
    )
    forked = [d["script"] for d in found if "script" in d]
    assert len(forked) == 2, found
    cold = [
        json.loads(
            subprocess.run(
                [sys.executable, "-u", "seeds.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
            ).stdout
        )
        for _ in range(2)
    ]
    # Two forks of one zygote differ where two cold starts differ (torch seeds its generator at import from
    # the OS, or keeps a fixed default seed: then both are the same everywhere).
    assert (forked[0]["seed"] != forked[1]["seed"]) == (cold[0]["seed"] != cold[1]["seed"])
    assert forked[0]["authkey"] != forked[1]["authkey"]


def test_a_zygotes_warm_up_asks_first_what_would_start_a_thread_then_stops_where_told():
    """`import numpy` (what `import torch` imports and what starts OpenBLAS's pool) comes first in a zygote's
    warm-up, so a zygote that cannot fork knows after 0.1 s of imports, not after torch's; told to stop, it
    imports nothing more. A standby's warm-up (no `stop`) is unchanged."""
    pytest.importorskip("numpy")
    code = textwrap.dedent(
        """
        import json, sys
        from ettr.bootstrap.standby import _warm_up
        _warm_up(["json"], stop=lambda: True)
        print(json.dumps({"numpy": "numpy" in sys.modules, "torch": "torch" in sys.modules}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"numpy": True, "torch": False}

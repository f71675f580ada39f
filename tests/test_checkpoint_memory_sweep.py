"""Memory copies of jobs that ended without removing theirs (a killed plain-torchrun job, a SIGKILLed
supervisor) are removed by the next ettr process on the node, and a live job's never are
(ettr.memory_sweep; liveness is a fake here, as is the boot)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ettr.checkpoint.memory import MemoryCopies
from ettr.checkpoint.snapshot import Binding
from ettr.memory_sweep import LEASE_SCHEMA, Lease, boot_id, keepers_of_this_process, sweep, write_lease

BOOT = "boot-a"
LIVE = {101, 202}
HOUR_S = 3600.0


def _alive(pid: int, ticks: int | None) -> bool:
    return pid in LIVE


def _copies_dir(root: Path, name: str, *leases: dict | str, age_s: float = 0.0) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "rank-0.snap").write_bytes(b"x" * 64)
    (directory / "owner").write_text("/runs/job\n")
    for i, lease in enumerate(leases):
        text = lease if isinstance(lease, str) else json.dumps(lease)
        (directory / f"lease-{1000 + i}-0").write_text(text)
    if age_s:
        old = time.time() - age_s
        for path in [directory, *directory.iterdir()]:
            os.utime(path, (old, old), follow_symlinks=False)
    return directory


def _lease(*pids: int, boot: str = BOOT) -> dict:
    return {"schema": LEASE_SCHEMA, "boot_id": boot, "keepers": [[pid, 7] for pid in pids]}


def _sweep(root: Path) -> set[str]:
    return {p.name for p in sweep(root, current_boot=BOOT, alive=_alive, unowned_max_age_s=HOUR_S)}


def test_copies_whose_keepers_are_gone_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    root = tmp_path / "memory"
    root.mkdir(mode=0o700)
    _copies_dir(root, "ckpt-live", _lease(999, 101))  # the rank died, its supervisor (101) restarts it
    _copies_dir(root, "ckpt-two-ranks", _lease(998), _lease(202))  # one rank of two still runs
    _copies_dir(root, "ckpt-dead", _lease(998, 997), _lease(996), age_s=11 * 60)  # a killed job: nobody left
    _copies_dir(root, "ckpt-just-dead", _lease(998), age_s=60)  # a minute ago: its rerun may still restore
    _copies_dir(root, "ckpt-other-boot", _lease(101, boot="boot-b"))  # pid 101 of another boot is not ours
    _copies_dir(root, "ckpt-legacy-new", age_s=60)  # no lease (an older ettr's): unchanged for a minute
    _copies_dir(root, "ckpt-legacy-old", age_s=2 * HOUR_S)
    _copies_dir(root, "ckpt-forged-lease", "{nope", _lease(998))  # an unreadable lease: unknown, not dead
    _copies_dir(
        root, "ckpt-forged-old", '{"schema": "ettr.memory-lease/1", "keepers": [[1, 0]]}', age_s=2 * HOUR_S
    )
    (root / "inplace-202-abcdef").mkdir()  # a live supervisor's in-place store
    (root / "inplace-998-abcdef").mkdir()  # a SIGKILLed supervisor's
    (root / "inplace-998-abcdef.store").write_text("")  # a FileStore file: not a directory of copies
    (root / "unrelated").mkdir()
    assert _sweep(root) == {"ckpt-dead", "ckpt-other-boot", "ckpt-legacy-old", "ckpt-forged-old",
                            "inplace-998-abcdef"}  # fmt: skip
    assert sorted(p.name for p in root.iterdir()) == [
        "ckpt-forged-lease", "ckpt-just-dead", "ckpt-legacy-new", "ckpt-live", "ckpt-two-ranks", "inplace-202-abcdef",
        "inplace-998-abcdef.store", "unrelated",
    ]  # fmt: skip
    assert _sweep(root) == set()


def test_the_sweep_follows_no_symlink_and_leaves_a_root_that_is_not_ours(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    _copies_dir(tmp_path, "victim", _lease(998))
    root = tmp_path / "memory"
    root.mkdir(mode=0o700)
    (root / "ckpt-link").symlink_to(victim)
    assert _sweep(root) == set()
    assert (victim / "rank-0.snap").exists()
    linked_root = tmp_path / "linked-root"
    linked_root.symlink_to(tmp_path)  # a root that is a symlink: nothing under it is ours to remove
    _copies_dir(tmp_path, "ckpt-dead", _lease(998))
    assert sweep(linked_root, current_boot=BOOT, alive=_alive) == []
    assert (tmp_path / "ckpt-dead").exists()
    assert sweep(tmp_path / "missing") == []


def test_a_lease_names_the_process_its_supervisor_and_its_torchrun_agent(tmp_path: Path) -> None:
    pid = os.getpid()
    assert [k[0] for k in keepers_of_this_process({})] == [pid]
    keepers = keepers_of_this_process({"ETTR_SUPERVISOR_PID": str(os.getppid())})
    assert [k[0] for k in keepers] == [pid, os.getppid()]
    keepers = keepers_of_this_process({"TORCHELASTIC_RUN_ID": "x", "ETTR_SUPERVISOR_PID": "junk"})
    assert [k[0] for k in keepers] == [pid, os.getppid()]
    for bad in ({"schema": LEASE_SCHEMA, "boot_id": "b", "keepers": [[True, 0]]},
                {"schema": LEASE_SCHEMA, "boot_id": "b", "keepers": [[2**40, 0]]},
                {"schema": LEASE_SCHEMA, "boot_id": "b", "keepers": []}, [1, 2]):  # fmt: skip
        try:
            Lease.parse(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_a_kept_copy_carries_a_lease_that_keeps_it_until_its_process_is_gone(tmp_path: Path) -> None:
    root = tmp_path / "memory"
    copies = MemoryCopies.for_root(root, "file:///ckpt", rank=0, owner=tmp_path / "run")
    binding = Binding(step=3, manifest_sha256="ab" * 32, world_size=1)
    assert copies.keep({"w": torch.ones(4)}, binding) > 0
    leases = [p for p in copies.directory.iterdir() if p.name.startswith("lease-")]
    assert len(leases) == 1 and json.loads(leases[0].read_text())["keepers"][0][0] == os.getpid()
    assert sweep(root) == []  # this process runs: real liveness keeps its copy

    def gone(pid: int, ticks: int | None) -> bool:
        return False

    assert sweep(root, alive=gone) == []  # gone a moment ago: the same job started again may restore from it
    assert sweep(root, alive=gone, now=time.time() + 601) == [
        copies.directory
    ]  # unchanged for 10 min: it goes
    assert copies.keep({"w": torch.ones(4)}, binding) > 0  # written again with its lease
    copies.remove_all()  # the job completed: the last rank out leaves nothing
    assert not copies.directory.exists()


def test_ettr_runs_own_imports_never_load_torch(tmp_path: Path) -> None:
    """`ettr run` sweeps memory copies at its start: the sweep and the supervisor must not import torch (a
    supervisor that imports torch starts seconds later, and hung on a test's held `import torch`)."""
    import subprocess
    import sys

    code = (
        "import sys, ettr.cli, ettr.memory_sweep, ettr.supervisor, ettr.fleet.stored\n"
        "ettr.memory_sweep.sweep()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    env = {**os.environ, "ETTR_MEMORY_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_replaced_ranks_lease_goes_once_its_replacement_leaves_its_own(tmp_path: Path) -> None:
    """Each restart of a supervised job replaces its ranks, and each new rank leaves a lease; the dead rank's
    lease, held by the supervisor that still runs, was kept until the job's end: one more per replaced rank
    (a soak: 9 after 7 restarts of 2 ranks). A new lease removes those it makes redundant, and no other."""
    directory = tmp_path / "ckpt-x"
    directory.mkdir()
    me = os.getpid()
    supervisor = os.getppid()  # a process that runs, standing for the job's `ettr run`
    keepers = {k[0]: k for k in keepers_of_this_process({"ETTR_SUPERVISOR_PID": str(supervisor)})}

    def lease_file(name: str, *pids: int, boot: str | None = None) -> None:
        ticks = [list(keepers.get(pid, (pid, 7))) for pid in pids]
        payload = {"schema": LEASE_SCHEMA, "boot_id": boot_id() if boot is None else boot, "keepers": ticks}
        (directory / name).write_text(json.dumps(payload))

    def alive(pid: int, ticks: int | None) -> bool:
        return pid in (me, supervisor, 4242)

    lease_file("lease-998-1", 998, supervisor)  # a rank killed two restarts ago
    lease_file("lease-997-1", 997, supervisor)  # its replacement, killed in turn
    lease_file("lease-4242-1", 4242, supervisor)  # the other rank, alive: its lease stays
    lease_file("lease-996-1", 996, 5151)  # a dead process of another job's keeper (dead too): not held
    lease_file("lease-995-1", 995, 4343, boot="another-boot")  # another boot: held by nobody
    lease_file("lease-994-1", 994, 4242)  # dead, but kept by a live process this lease does not name
    write_lease(directory, {"ETTR_SUPERVISOR_PID": str(supervisor)}, alive=alive)
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted(["lease-4242-1", "lease-994-1", f"lease-{me}-{keepers[me][1] or 0}"])


def test_the_last_rank_out_leaves_the_directory_while_another_ranks_process_runs(tmp_path: Path) -> None:
    # Rank 1 closed after the final commit while rank 0, which had no copy (none fitted), was about to write
    # its copy: rank 1 removed the directory under it, and a completed job warned "memory copy of step N
    # failed (No such file or directory ...)".
    from ettr.memory_sweep import lease_name

    root = tmp_path / "memory"
    rank1 = MemoryCopies.for_root(root, "file:///ckpt", rank=1, owner=tmp_path / "run")
    assert rank1.keep({"w": torch.ones(4)}, Binding(step=3, manifest_sha256="ab" * 32, world_size=2)) > 0
    other = rank1.directory / lease_name(os.getppid())  # rank 0's process, running
    other.write_text("{}")
    rank1.remove_all()
    assert rank1.directory.exists() and not rank1.own_path().exists()  # rank 0 removes it, or `ettr run`
    other.unlink()
    (rank1.directory / "lease-999999999-1").write_text("{}")  # a rank that is gone holds nothing
    rank1.remove_all()
    assert not rank1.directory.exists()

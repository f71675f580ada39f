"""The publish queue and requests: idempotent enqueue, exclusive claims, takeover of dead or expired claims.

Pure file-system tests (no model, no torch work); the crash of a real publisher process is in
`test_publish_process.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ettr.cli import main as cli_main
from ettr.procs import pid_alive
from ettr.procs import start_ticks as process_start_ticks
from ettr.publish.queue import MAX_CLAIM_TTL_S, PublishQueue
from ettr.publish.request import InputKind, InputSpec, ModelSpec, PublishError, PublishRequest, request_id_for
from ettr.publish.worker import WorkerConfig


def make_request(tmp_path, step: int = 7, job_id: str = "job-1") -> PublishRequest:
    anchor_root = str(tmp_path / "anchor")
    request_id = request_id_for(job_id, anchor_root, step)
    return PublishRequest(
        request_id=request_id,
        job_id=job_id,
        anchor_root=anchor_root,
        step=step,
        world_size=2,
        model=ModelSpec(factory="torch.nn:Linear", config={"in_features": 3, "out_features": 1}),
        inputs=(InputSpec(name="x"), InputSpec(name="sparse", kind="jagged", keys=("f0", "f1"))),
        artifact_dir=str(tmp_path / "artifacts" / request_id),
        run_dir=str(tmp_path / "runs" / request_id),
        created_ts=123.0,
    )


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_request_round_trips_through_json_and_its_id_is_stable(tmp_path):
    request = make_request(tmp_path)
    again = PublishRequest.from_json(request.to_json())
    assert again == request
    assert again.inputs[1].kind is InputKind.JAGGED and again.inputs[1].tensor_names == (
        "sparse.values",
        "sparse.lengths",
    )
    assert request_id_for("job-1", request.anchor_root, 7) == request.request_id
    assert request_id_for("job-1", request.anchor_root, 8) != request.request_id
    assert request_id_for("job/with spaces", "x", 1).startswith("job_with_spaces-step000000001-")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dtype": "float16"}, "dtype"),
        ({"step": -1}, "step"),
        ({"inputs": ()}, "input"),
        ({"request_id": "../escape"}, "request_id"),
        ({"rtol": -1.0}, "rtol"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(tmp_path, change, message):
    body = json.loads(make_request(tmp_path).to_json())
    body.update(change)
    with pytest.raises(PublishError, match=message):
        PublishRequest.from_json(json.dumps(body))


def test_model_spec_checks_its_factory_path_and_config():
    with pytest.raises(ValueError, match="import path"):
        ModelSpec(factory="not a path")
    with pytest.raises(ValueError, match="JSON"):
        ModelSpec(factory="torch.nn:Linear", config={"x": object()})
    with pytest.raises(PublishError, match="cannot import"):
        ModelSpec(factory="no_such_module_xyz:build").build()
    with pytest.raises(PublishError, match="no attribute"):
        ModelSpec(factory="torch.nn:NoSuchLayer").build()
    with pytest.raises(PublishError, match="could not build"):
        ModelSpec(factory="torch.nn:Linear", config={"wrong": 1}).build()
    built = ModelSpec(factory="torch.nn:Linear", config={"in_features": 2, "out_features": 3}).build()
    assert built.out_features == 3


def test_enqueue_is_idempotent_while_queued_and_after_it_is_done(tmp_path):
    queue = PublishQueue(tmp_path / "q")
    request = make_request(tmp_path)
    assert queue.enqueue(request) is True
    assert queue.enqueue(request) is False
    assert queue.pending() == [request.request_id]
    claim = queue.try_claim(request.request_id, ttl_s=60)
    queue.complete(claim, {"artifact_dir": request.artifact_dir})
    assert queue.enqueue(request) is False  # done: enqueueing it again changes nothing
    assert queue.pending() == []
    assert queue.status(request.request_id) == "done"
    assert queue.load(request.request_id) == request  # still readable from the archive
    assert queue.result(request.request_id)["artifact_dir"] == request.artifact_dir
    assert not (tmp_path / "q" / "claims" / f"{request.request_id}.json").exists()


def test_a_claim_is_exclusive_while_its_owner_lives(tmp_path):
    queue = PublishQueue(tmp_path / "q")
    request = make_request(tmp_path)
    queue.enqueue(request)
    first = queue.try_claim(request.request_id, ttl_s=60)
    assert first is not None and first.attempt == 0
    assert queue.try_claim(request.request_id, ttl_s=60) is None  # our own pid is alive
    assert queue.owns(first) and queue.renew(first)
    queue.release(first)
    again = queue.try_claim(request.request_id, ttl_s=60)
    assert again is not None and again.attempt == 0  # a release is not a failure


def _plant_claim(queue: PublishQueue, request_id: str, **body) -> None:
    path = queue.root / "claims" / f"{request_id}.json"
    path.write_text(
        json.dumps({"request_id": request_id, "token": "old", "attempt": 0, "ttl_s": 60.0, **body})
    )


def test_a_dead_owners_claim_is_taken_over_with_the_next_attempt(tmp_path):
    clock = FakeClock()
    queue = PublishQueue(tmp_path / "q", clock=clock)
    request = make_request(tmp_path)
    queue.enqueue(request)
    pid = dead_pid()
    _plant_claim(
        queue, request.request_id, pid=pid, host=queue._host, renewed_ts=clock.now, claimed_ts=clock.now - 5,
        first_claimed_ts=clock.now - 5, attempt=1,
    )  # fmt: skip
    assert not pid_alive(pid, None)
    claim = queue.try_claim(request.request_id, ttl_s=60)
    assert claim is not None and claim.attempt == 2
    assert claim.previous["pid"] == pid and claim.first_claimed_ts == clock.now - 5
    assert queue.owns(claim)


def test_a_live_claim_on_another_host_is_respected_until_its_lease_expires(tmp_path):
    clock = FakeClock()
    queue = PublishQueue(tmp_path / "q", clock=clock, host="here")
    request = make_request(tmp_path)
    queue.enqueue(request)
    _plant_claim(
        queue, request.request_id, pid=1, host="elsewhere", renewed_ts=clock.now, first_claimed_ts=clock.now
    )
    clock.now += 59
    assert queue.try_claim(request.request_id, ttl_s=60) is None
    clock.now += 2  # 61 s without a renewal
    claim = queue.try_claim(request.request_id, ttl_s=60)
    assert claim is not None and claim.attempt == 1 and claim.previous["host"] == "elsewhere"


def test_a_reused_pid_does_not_keep_a_dead_claim_alive(tmp_path):
    queue = PublishQueue(tmp_path / "q")
    request = make_request(tmp_path)
    queue.enqueue(request)
    ticks = process_start_ticks(os.getpid())
    if ticks is None:
        pytest.skip("no /proc on this system")
    # Our pid, but a different start time: the claim's process is gone and the pid was reused.
    _plant_claim(
        queue,
        request.request_id,
        pid=os.getpid(),
        pid_start_ticks=ticks + 1,
        host=queue._host,
        renewed_ts=queue._clock(),
    )
    assert queue.try_claim(request.request_id, ttl_s=60) is not None


def test_a_takeover_never_steals_a_claim_made_after_its_look(tmp_path):
    clock = FakeClock()
    queue = PublishQueue(tmp_path / "q", clock=clock)
    request = make_request(tmp_path)
    queue.enqueue(request)
    path = queue.root / "claims" / f"{request.request_id}.json"
    stale = {"token": "stale", "pid": 1, "host": "elsewhere", "renewed_ts": 0.0, "ttl_s": 1.0}
    # Another publisher replaced the stale claim after we read it: our takeover must put theirs back.
    path.write_text(
        json.dumps({"token": "fresh", "pid": 1, "host": "elsewhere", "renewed_ts": clock.now, "ttl_s": 60.0})
    )
    assert queue._take_aside(path, stale) is False
    assert json.loads(path.read_text())["token"] == "fresh"
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_renewal_fails_once_the_claim_was_taken_over(tmp_path):
    clock = FakeClock()
    mine = PublishQueue(tmp_path / "q", clock=clock, host="a")
    theirs = PublishQueue(tmp_path / "q", clock=clock, host="b")
    request = make_request(tmp_path)
    mine.enqueue(request)
    claim = mine.try_claim(request.request_id, ttl_s=10)
    clock.now += 11  # we stalled past our lease
    taken = theirs.try_claim(request.request_id, ttl_s=10)
    assert taken is not None and taken.attempt == 1
    assert mine.renew(claim) is False and not mine.owns(claim)
    mine.release(claim)  # must not remove their claim
    assert theirs.owns(taken)


def test_a_finished_request_is_tidied_from_pending(tmp_path):
    queue = PublishQueue(tmp_path / "q")
    request = make_request(tmp_path)
    queue.enqueue(request)
    # A publisher that died after writing the done record but before moving the request away.
    (queue.root / "done" / f"{request.request_id}.json").write_text("{}")
    assert queue.pending() == []
    assert not (queue.root / "requests" / f"{request.request_id}.json").exists()
    assert queue.try_claim(request.request_id, ttl_s=60) is None


def test_failing_records_the_error_and_never_retries(tmp_path):
    queue = PublishQueue(tmp_path / "q")
    request = make_request(tmp_path)
    queue.enqueue(request)
    claim = queue.try_claim(request.request_id, ttl_s=60)
    queue.fail(claim, "bad factory")
    assert queue.status(request.request_id) == "failed"
    assert queue.result(request.request_id)["error"] == "bad factory"
    assert queue.try_claim(request.request_id, ttl_s=60) is None
    assert queue.load(request.request_id) == request


ALLOW = ("--allow-factory", "torch.nn.*")


@pytest.mark.parametrize(
    "argv",
    [
        ["publish"],
        ["publish", "/definitely/not/a/queue"],
        ["publish", "QUEUE", "--lease-ttl", "0", *ALLOW],
        ["publish", "QUEUE", "--max-attempts", "0", *ALLOW],
        ["publish", "QUEUE", "--request", "nope", *ALLOW],
        ["publish", "QUEUE", "--request", "../../etc/passwd", *ALLOW],
        ["publish", "QUEUE", "--watch", "--request", "x", *ALLOW],
        ["publish", "QUEUE"],  # no factory allowed: the operator forgot the flag
        ["publish", "QUEUE", "--allow-factory", "os:system;rm"],
        ["publish", "QUEUE", "--allow-factory", "*"],
        ["publish", "QUEUE", *ALLOW, "--root", "relative\0dir"],
    ],
)
def test_bad_publish_usage_is_one_line_and_status_2(tmp_path, argv, capsys):
    queue = PublishQueue(tmp_path / "q", create=True)
    if "--watch" in argv:
        queue.enqueue(make_request(tmp_path))
        argv = [a if a != "x" else make_request(tmp_path).request_id for a in argv]
    argv = [str(queue.root) if a == "QUEUE" else a for a in argv]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_publish_on_an_empty_queue_says_so_and_succeeds(tmp_path, capsys):
    queue = PublishQueue(tmp_path / "q", create=True)
    assert cli_main(["publish", str(queue.root), "--json", *ALLOW]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["outcomes"] == []
    assert "nothing to publish" in captured.err


# -- the queue's layout is never reached through a symlink (field trial: a symlinked requests/ had a
# -- victim's files moved into failed/; a symlinked claims/ had claims made in another directory)


def _tree(directory) -> dict[str, bytes]:
    """Every file below `directory` (relative name -> bytes): what a refused publisher must leave alone."""
    return {
        os.path.relpath(os.path.join(top, name), directory): open(os.path.join(top, name), "rb").read()
        for top, _, names in os.walk(directory)
        for name in names
    }


@pytest.mark.parametrize("sub", ["requests", "claims", "done", "failed"])
def test_a_symlinked_queue_directory_is_refused_and_nothing_outside_is_touched(tmp_path, sub, capsys):
    queue = PublishQueue(tmp_path / "q", create=True)
    queue.enqueue(make_request(tmp_path))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.json").write_text('{"precious": true}')
    (victim / "other.request.json").write_text("{}")
    before = _tree(victim)
    kept = tmp_path / "kept"
    (queue.root / sub).rename(kept)
    (queue.root / sub).symlink_to(victim, target_is_directory=True)
    assert cli_main(["publish", str(queue.root), *ALLOW]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{sub} is a symlink" in err
    assert _tree(victim) == before  # nothing moved out of it, nothing created in it
    with pytest.raises(PublishError, match="is a symlink"):  # the API says the same
        PublishQueue(queue.root).pending()
    with pytest.raises(PublishError, match="is a symlink"):
        PublishQueue(queue.root, create=True)
    assert _tree(victim) == before


def test_a_queue_directory_that_is_a_file_is_refused(tmp_path, capsys):
    queue = PublishQueue(tmp_path / "q", create=True)
    queue.enqueue(make_request(tmp_path))
    (queue.root / "done").rmdir()
    (queue.root / "done").write_text("not a directory")
    assert cli_main(["publish", str(queue.root), *ALLOW]) == 2
    err = capsys.readouterr().err
    assert "done is a regular file, not a directory" in err and len(err.strip().splitlines()) == 1


def test_missing_queue_directories_are_made_and_the_request_handled(tmp_path, capsys):
    # Field trial: a queue with requests/ but no claims/ failed every request on the claim's temporary
    # file (FileNotFoundError), left them in requests/ and made only failed/.
    queue = PublishQueue(tmp_path / "q", create=True)
    request = make_request(tmp_path)  # names torch.nn:Linear, which this publisher does not allow
    queue.enqueue(request)
    for sub in ("claims", "done", "failed"):
        (queue.root / sub).rmdir()
    assert cli_main(["publish", str(queue.root), "--allow-factory", "mypkg.*"]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {request.request_id}: factory 'torch.nn:Linear' is not allowed" in out, out
    assert all((queue.root / sub).is_dir() for sub in ("claims", "done", "failed"))
    assert queue.status(request.request_id) == "failed"
    assert not list((queue.root / "requests").iterdir())  # handled: moved to failed/, not left behind


def test_a_queue_root_that_is_a_symlink_is_the_users_choice(tmp_path, capsys):
    real = PublishQueue(tmp_path / "real-q", create=True)
    request = make_request(tmp_path)
    real.enqueue(request)
    (tmp_path / "q").symlink_to(real.root, target_is_directory=True)
    assert cli_main(["publish", str(tmp_path / "q"), "--allow-factory", "mypkg.*"]) == 1
    assert f"FAILED {request.request_id}" in capsys.readouterr().out
    assert real.status(request.request_id) == "failed"


@pytest.mark.parametrize(
    "forged",
    [
        {"renewed_ts": 32503680000.0, "ttl_s": 60.0},  # renewed in the year 3000
        {"renewed_ts": "now", "ttl_s": 1e300},  # a lease of 1e300 s (renewed_ts set below)
        {"renewed_ts": "now", "ttl_s": float("inf")},
        {"renewed_ts": float("nan"), "ttl_s": 60.0},
        {"renewed_ts": 1e400, "ttl_s": 60.0},  # Infinity once parsed
    ],
)
def test_a_forged_claim_holds_its_request_no_longer_than_a_day(tmp_path, forged):
    """Whoever writes the queue can write `claims/ID.json`: one renewed in the future or with an endless
    lease was never stale, and the request (anyone's) was never published."""
    clock = FakeClock()
    queue = PublishQueue(tmp_path / "q", clock=clock, host="here")
    request = make_request(tmp_path)
    queue.enqueue(request)
    body = {**forged, "renewed_ts": clock.now if forged["renewed_ts"] == "now" else forged["renewed_ts"]}
    _plant_claim(queue, request.request_id, pid=1, host="elsewhere", **body)
    clock.now += MAX_CLAIM_TTL_S + 1
    claim = queue.try_claim(request.request_id, ttl_s=60)
    assert claim is not None  # taken over (NaN and Infinity: unreadable, so stale, as garbled ones)


def test_a_lease_longer_than_other_publishers_respect_is_refused():
    with pytest.raises(ValueError, match="at most"):
        WorkerConfig(lease_ttl_s=MAX_CLAIM_TTL_S * 2)


def test_a_fifo_in_requests_is_moved_aside_with_why_not_skipped_for_ever(tmp_path):
    """A FIFO named like a request was listed as pending and never claimable (its status is no file's), so
    every drain passed it over in silence. It is moved to `failed/.rejected-*` with a note saying why,
    unread (a FIFO would block a read)."""
    queue = PublishQueue(tmp_path / "q")
    queue.open_layout()
    requests = queue.root / "requests"
    os.mkfifo(requests / "job-fifo.json")
    assert queue.pending() == []
    assert list(requests.iterdir()) == []
    notes = [json.loads(p.read_text()) for p in (queue.root / "failed").glob(".rejected-*[0-9a-f].json")]
    assert [n["name"] for n in notes] == ["job-fifo.json"]
    assert "not a regular file" in notes[0]["error"]


def test_a_symlinked_failed_request_is_no_request_to_retry(tmp_path):
    """`failed/X.request.json` planted as a symlink: `--retry` moved it back to `requests/`, where it failed
    again (a symlink is never read), at every retry. It is no failed request."""
    queue = PublishQueue(tmp_path / "q")
    queue.open_layout()
    request = make_request(tmp_path)
    (tmp_path / "target.json").write_text(request.to_json().decode())
    failed = queue.root / "failed"
    (failed / f"{request.request_id}.json").write_text('{"error": "x"}')
    os.symlink(tmp_path / "target.json", failed / f"{request.request_id}.request.json")
    assert queue.failed() == []
    assert queue.requeue(request.request_id) is False
    assert queue.pending() == []

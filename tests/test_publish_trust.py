"""The publisher's trust boundary (docs/trust.md): a request names only allowed code and paths inside the
roots; any malformed request is failed and moved aside, and never blocks the requests queued after it."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ettr.cli import main as cli_main
from ettr.ledger import open_ledger
from ettr.publish import ModelSpec, PublishConfig, PublishQueue, PublishWorker, load_artifact, publish_at_end
from ettr.publish.policy import PublishPolicy, parse_allow_entry
from ettr.publish.request import PublishError, PublishRequest
from ettr.recorder import Recorder

LINEAR = ModelSpec(factory="torch.nn:Linear", config={"in_features": 4, "out_features": 3})


def enqueue_linear(tmp_path: Path, spec: ModelSpec = LINEAR, step: int = 5) -> str:
    """A real anchor and request for a Linear layer, as a training job leaves them; returns the request id."""
    torch.manual_seed(0)
    run_dir = tmp_path / "train-run"
    recorder = Recorder(open_ledger(run_dir), run_dir=run_dir, job_id="train-1")
    config = PublishConfig(
        anchor_root=tmp_path / "anchors", queue_dir=tmp_path / "queue", model=spec, input_names=("x",)
    )
    try:
        result = publish_at_end(
            torch.nn.Linear(4, 3),
            step=step,
            config=config,
            sample_inputs=(torch.randn(6, 4),),
            recorder=recorder,
        )
    finally:
        recorder.close()
    return result.request_id


def request_body(tmp_path: Path, request_id: str) -> dict:
    return json.loads((tmp_path / "queue" / "requests" / f"{request_id}.json").read_text())


def plant(tmp_path: Path, name: str, body: dict | str | bytes) -> None:
    """A request file written by whoever can write the queue (no checks on the way in)."""
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    path = tmp_path / "queue" / "requests" / f"{name}.json"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.utime(path, (1, 1))  # oldest first: queued before the good request


def worker(tmp_path: Path, **policy) -> PublishWorker:
    policy.setdefault("allow", ["torch.nn.*"])
    return PublishWorker(
        tmp_path / "queue", policy=PublishPolicy.for_queue(tmp_path / "queue", entry_points=False, **policy)
    )


def test_a_factory_outside_the_allow_list_never_runs(tmp_path):
    good = enqueue_linear(tmp_path)
    marker = tmp_path / "pwned"
    body = request_body(tmp_path, good)
    evil = dict(body, request_id="evil", model=dict(body["model"], factory="os:system", config={}))
    evil["model"]["config_type"] = None
    plant(tmp_path, "evil", evil)
    # config_type is code too: `os:system` there would be called with the config.
    sneaky = dict(body, request_id="sneaky")
    sneaky["model"] = dict(body["model"], config_type="os:system", config={"command": f"touch {marker}"})
    plant(tmp_path, "sneaky", sneaky)

    outcomes = {o.request_id: o for o in worker(tmp_path).drain()}
    assert outcomes["evil"].status == "failed" and "not allowed" in outcomes["evil"].error
    assert outcomes["sneaky"].status == "failed" and "config_type" in outcomes["sneaky"].error
    assert outcomes[good].status == "published", outcomes[good].error
    assert not marker.exists()
    queue = PublishQueue(tmp_path / "queue")
    assert (
        queue.status("evil") == "failed" and (tmp_path / "queue" / "failed" / "evil.request.json").is_file()
    )
    assert not (tmp_path / "queue" / "requests" / "evil.json").exists()  # moved aside


def test_a_wildcard_entry_allows_only_what_its_package_defines(tmp_path, monkeypatch):
    package = tmp_path / "code" / "trustpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import os\nfrom os import system\n\ndef build():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    policy = PublishPolicy.for_queue(tmp_path / "queue", allow=["trustpkg.*"], entry_points=False)
    import trustpkg

    policy.check_resolved("trustpkg:build", trustpkg.build)
    for name, obj in (("trustpkg:system", os.system), ("trustpkg:os.system", os.system), ("trustpkg:os", os)):
        with pytest.raises(PublishError):
            policy.check_resolved(name, obj)
    assert not policy.allows_name("trustpkg:_private") and not policy.allows_name("trustpkg_evil.x:y")
    assert not policy.allows_name("os:system") and policy.allows_name("trustpkg.sub:build")
    exact = PublishPolicy.for_queue(tmp_path / "q", allow=["torch.nn:Linear"], entry_points=False)
    assert exact.allows_name("torch.nn:Linear") and not exact.allows_name("torch.nn:Conv2d")


@pytest.mark.parametrize("entry", ["*", "os", "os:", ":system", "os:system;rm", "os.*.x", "a b:c"])
def test_malformed_allow_entries_are_refused(entry):
    with pytest.raises(ValueError):
        parse_allow_entry(entry)


def test_paths_outside_the_roots_and_foreign_pythonpath_are_refused(tmp_path):
    good = enqueue_linear(tmp_path)
    body = request_body(tmp_path, good)
    outside = str(tmp_path.parent / f"{tmp_path.name}-outside")
    cases = {
        "art": {"artifact_dir": outside},
        "dots": {"artifact_dir": str(tmp_path / "queue" / ".." / ".." / f"{tmp_path.name}-x")},
        "rel": {"artifact_dir": "relative/artifact"},
        "run": {"run_dir": "/etc/ettr-run"},
        "anchor": {"anchor_root": "/"},
        "url": {"anchor_root": "s3://bucket/anchors"},
        "pypath": {"model": dict(body["model"], pythonpath=[str(tmp_path / "queue")])},
    }
    link = tmp_path / "queue" / "escape"
    link.symlink_to(outside, target_is_directory=True)
    cases["link"] = {"artifact_dir": str(link / "artifact")}
    for name, change in cases.items():
        plant(tmp_path, name, dict(body, request_id=name, **change))
    outcomes = {o.request_id: o for o in worker(tmp_path).drain()}
    for name in cases:
        assert outcomes[name].status == "failed", name
        assert "outside" in outcomes[name].error, (name, outcomes[name].error)
    assert outcomes[good].status == "published"
    assert not Path(outside).exists() and not Path("/etc/ettr-run").exists()


def test_a_body_id_that_differs_from_its_file_name_is_refused(tmp_path):
    good = enqueue_linear(tmp_path)
    plant(tmp_path, "other-name", request_body(tmp_path, good))  # a copy claiming to be the good one
    outcomes = {o.request_id: o for o in worker(tmp_path).drain()}
    assert outcomes["other-name"].status == "failed" and "file" in outcomes["other-name"].error
    assert outcomes[good].status == "published"


MALFORMED = {
    "inf": lambda b: json.dumps(b).replace('"step": 5', '"step": 1e400'),
    "huge_float_tol": lambda b: json.dumps(dict(b, rtol=1)).replace('"rtol": 1', '"rtol": 1e400'),
    "nan": lambda b: json.dumps(b).replace('"step": 5', '"step": NaN'),
    "nested": lambda b: json.dumps(dict(b, model=dict(b["model"], config={"a": 0}))).replace(
        '{"a": 0}', "[" * 100_000 + "]" * 100_000
    ),
    "step_str": lambda b: json.dumps(dict(b, step="5")),
    "step_bool": lambda b: json.dumps(dict(b, step=True)),
    "step_float": lambda b: json.dumps(dict(b, step=5.5)),
    "big_int": lambda b: json.dumps(b).replace('"step": 5', '"step": ' + "9" * 5000),
    "format": lambda b: json.dumps(dict(b, format="ettr.publish-request/99")),
    "array": lambda b: "[1, 2, 3]",
    "not_json": lambda b: "\xff\xfe{",
    "empty": lambda b: "",
    "inputs": lambda b: json.dumps(dict(b, inputs="x")),
    "model": lambda b: json.dumps(dict(b, model=None)),
    "too_big": lambda b: json.dumps(dict(b, pad="x" * (2 << 20))),
}


def test_any_malformed_request_is_failed_moved_aside_and_never_blocks_the_queue(tmp_path):
    good = enqueue_linear(tmp_path)
    body = request_body(tmp_path, good)
    for name, make in MALFORMED.items():
        plant(tmp_path, name, make(dict(body, request_id=name)))
    (tmp_path / "queue" / "requests" / "dir.json").mkdir()
    (tmp_path / "queue" / "requests" / "link.json").symlink_to("/etc/hostname")
    outcomes = {o.request_id: o for o in worker(tmp_path).drain()}
    for name in [*MALFORMED, "link"]:
        assert outcomes[name].status == "failed", name
        assert PublishQueue(tmp_path / "queue").status(name) == "failed", name
    assert outcomes[good].status == "published", outcomes[good].error
    assert worker(tmp_path).drain() == []  # nothing left that a publisher would retry


@pytest.mark.parametrize("name", ["a" * 250, "two words", "new\nline", "semi;colon"])
def test_a_file_whose_name_is_no_request_id_is_moved_aside_unread(tmp_path, name):
    good = enqueue_linear(tmp_path)
    plant(tmp_path, name, request_body(tmp_path, good))
    outcomes = worker(tmp_path).drain()
    assert [(o.request_id, o.status) for o in outcomes] == [(good, "published")]
    assert not (tmp_path / "queue" / "requests" / f"{name}.json").exists()
    assert [p.name for p in (tmp_path / "queue" / "failed").glob(".rejected-*.request.json")]


def test_a_watching_publisher_survives_a_malformed_request(tmp_path):
    good = enqueue_linear(tmp_path)
    plant(tmp_path, "nested", "[" * 200_000)
    stop = threading.Event()
    outcomes = worker(tmp_path, allow=["torch.nn.*"]).watch(stop, max_requests=2)
    assert {o.request_id: o.status for o in outcomes} == {"nested": "failed", good: "published"}


def test_the_cli_with_one_flag_publishes_and_refuses(tmp_path, capsys):
    good = enqueue_linear(tmp_path)
    body = request_body(tmp_path, good)
    plant(tmp_path, "evil", dict(body, request_id="evil", model=dict(body["model"], factory="os:system")))
    assert cli_main(["publish", str(tmp_path / "queue"), "--json", "--allow-factory", "torch.nn.*"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert {o["request_id"]: o["status"] for o in out["outcomes"]} == {"evil": "failed", good: "published"}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
_VALID = {
    "format": "ettr.publish-request/1",
    "request_id": "r1",
    "job_id": "j",
    "anchor_root": "/data/anchors",
    "step": 3,
    "world_size": 1,
    "model": {
        "factory": "torch.nn:Linear",
        "config": {"in_features": 2},
        "config_type": None,
        "pythonpath": [],
    },
    "inputs": [{"name": "x", "kind": "tensor", "keys": [], "weighted": False}],
    "artifact_dir": "/data/artifacts/r1",
    "run_dir": None,
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from([*_VALID, "model.factory", "model.config", "inputs.0", "model.pythonpath"]),
    value=_JSON,
)
def test_fuzz_the_request_schema_only_ever_raises_publish_error(field, value):
    body = json.loads(json.dumps(_VALID))
    target, _, key = field.rpartition(".")
    holder = body
    for part in target.split(".") if target else []:
        holder = holder[int(part)] if isinstance(holder, list) else holder[part]
    if isinstance(holder, list):
        holder[int(key)] = value
    else:
        holder[key] = value
    policy = PublishPolicy(allowed_factories=("torch.nn.*",), roots=("/data",))
    try:
        request = PublishRequest.from_json(json.dumps(body))
        policy.check(request, file_id="r1")
    except PublishError:
        pass


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzz_request_bytes_only_ever_raise_publish_error(data):
    try:
        PublishRequest.from_json(data)
    except PublishError:
        pass


def test_entry_points_are_allowed_exactly(tmp_path, monkeypatch):
    import importlib.metadata

    found = [importlib.metadata.EntryPoint("linear", "torch.nn:Linear", "ettr.publish_factories")]
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group: found if group == "ettr.publish_factories" else []
    )
    policy = PublishPolicy.for_queue(tmp_path / "queue")
    assert policy.allows_name("torch.nn:Linear") and not policy.allows_name("torch.nn:Conv2d")
    with pytest.raises(ValueError, match="no model factory"):
        monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
        PublishPolicy.for_queue(tmp_path / "queue")


def test_what_a_request_names_reaches_the_operators_terminal_with_its_escapes_written_out(tmp_path, capsys):
    """A request's anchor root holding an escape sequence (OSC 52 sets the clipboard of some terminals) was
    quoted raw in `FAILED ...` and in the warning: whoever writes the queue wrote to the operator's terminal."""
    good = enqueue_linear(tmp_path)
    forged = "\x1b]52;c;ZXZpbA==\x07\x1b[2J"
    body = request_body(tmp_path, good)
    plant(tmp_path, "evil", dict(body, request_id="evil", anchor_root=f"{body['anchor_root']}{forged}"))
    argv = ["publish", str(tmp_path / "queue"), "--allow-factory", "torch.nn.*"]
    assert cli_main(argv) == 1
    out, err = capsys.readouterr()
    assert "FAILED evil" in out and "\\x1b]52;c;ZXZpbA==\\x07" in out
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert cli_main([*argv, "--request", "evil"]) == 1  # failed already: its status says so
    out, err = capsys.readouterr()
    assert "evil is failed already" in out and "\x1b" not in out + err


def test_a_request_failed_for_the_publishers_own_allowances_is_published_by_retry(tmp_path, capsys):
    """A first publisher run without the right --allow-factory fails the request; it used to stay failed for
    good (`--request ID` said "is failed already", and only moving files by hand helped). `--retry` puts it
    back in the queue and this run's allowances publish it; anything not failed is left as it is."""
    good = enqueue_linear(tmp_path)
    queue = str(tmp_path / "queue")
    assert cli_main(["publish", queue, "--allow-factory", "torch.optim.*"]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {good}" in out and "--retry" in out
    assert cli_main(["publish", queue, "--allow-factory", "torch.nn.*", "--request", good]) == 1
    assert "--retry publishes it again" in capsys.readouterr().out
    assert PublishQueue(tmp_path / "queue").failed() == [good]

    assert cli_main(["publish", queue, "--allow-factory", "torch.nn.*", "--retry", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(o["request_id"], o["status"]) for o in out["outcomes"]] == [(good, "published")]
    assert PublishQueue(tmp_path / "queue").status(good).value == "done"
    assert PublishQueue(tmp_path / "queue").failed() == []
    # nothing failed any more: --retry is a no-op
    assert cli_main(["publish", queue, "--allow-factory", "torch.nn.*", "--retry"]) == 0
    assert "nothing to publish" in capsys.readouterr().out


def test_requeue_puts_back_only_failed_requests_and_a_crash_midway_leaves_it_failed(tmp_path):
    good = enqueue_linear(tmp_path)
    queue = PublishQueue(tmp_path / "queue")
    assert queue.requeue(good) is False  # pending, not failed: nothing to do
    claim = queue.try_claim(good, ttl_s=60)
    assert claim is not None
    queue.fail(claim, "not allowed")
    assert queue.failed() == [good]
    # a crash after the request went back but before the failure record was removed: still failed
    os.replace(
        tmp_path / "queue" / "failed" / f"{good}.request.json",
        tmp_path / "queue" / "requests" / f"{good}.json",
    )
    assert queue.pending() == [] and queue.failed() == [good]
    assert queue.requeue(good) is True
    assert queue.status(good).value == "pending" and queue.pending() == [good]
    assert queue.failed() == []


@pytest.mark.parametrize(
    "bad", [["--watch"], ["--lease-ttl", "-1"], ["--max-attempts", "0"], ["--poll-interval", "0"]]
)
def test_a_refused_retry_run_moves_nothing(tmp_path, capsys, bad):
    """`--retry` put failed requests back in the queue before `--watch --request` and the worker's settings
    were checked: a run that exited 2 for bad usage had moved them anyway."""
    good = enqueue_linear(tmp_path)
    queue = str(tmp_path / "queue")
    assert cli_main(["publish", queue, "--allow-factory", "torch.optim.*"]) == 1
    capsys.readouterr()
    argv = ["publish", queue, "--allow-factory", "torch.nn.*", "--retry", "--request", good, *bad]
    assert cli_main(argv) == 2
    assert PublishQueue(tmp_path / "queue").failed() == [good]


def test_an_anchor_deleted_before_it_was_published_fails_its_request_and_is_not_remade(tmp_path, capsys):
    """An anchor deleted (by retention) before its publisher came failed with "no manifest (incomplete: the
    save never committed)", untrue, and the publisher's lease left an empty anchor directory behind."""
    good = enqueue_linear(tmp_path)
    anchor = tmp_path / "anchors" / "step_000000005"
    for path in sorted(anchor.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    anchor.rmdir()
    assert cli_main(["publish", str(tmp_path / "queue"), "--allow-factory", "torch.nn.*"]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {good}" in out and "does not exist" in out and "never committed" not in out
    assert not anchor.exists()


LOSSY = '''
import torch


class Lossy(torch.nn.Module):
    """nanoGPT's GPT at inference: (logits, None) without targets."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, targets=None):
        logits = self.lin(x)
        return logits, (None if targets is None else logits.sum())
'''


def test_a_model_returning_none_for_its_loss_publishes(tmp_path, capsys):
    """A model returning `(logits, None)` (nanoGPT's GPT, Hugging Face models without labels) failed in
    `publish_at_end`, after the last step of training, and `ettr run` restarted the whole job for it."""
    import importlib.util

    code = tmp_path / "code"
    code.mkdir()
    (code / "ettr_test_lossy.py").write_text(LOSSY)
    loaded = importlib.util.spec_from_file_location("ettr_test_lossy_trainer", code / "ettr_test_lossy.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.Lossy()
    config = PublishConfig(
        anchor_root=tmp_path / "anchors",
        queue_dir=tmp_path / "queue",
        model=ModelSpec(factory="ettr_test_lossy:Lossy", pythonpath=(str(code),)),
        input_names=("x",),
    )
    result = publish_at_end(model, step=3, config=config, sample_inputs=(torch.randn(6, 4),))
    argv = ["publish", str(tmp_path / "queue"), "--allow-factory", "ettr_test_lossy:Lossy"]
    assert cli_main([*argv, "--allow-pythonpath", str(code), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(o["request_id"], o["status"]) for o in out["outcomes"]] == [(result.request_id, "published")]
    artifact = load_artifact(out["outcomes"][0]["artifact_dir"])
    assert artifact.check().ok
    x = torch.randn(5, 4)
    logits, loss = artifact(x)
    assert loss is None and torch.equal(logits, model(x)[0].detach())

"""The HTML report: built from scripted event streams through the real accounting, checked as HTML (every
bucket in the legend, escaping, determinism, the numbers the charts show) and rendered in headless
Chromium (the charts paint, the script runs without an error)."""

from __future__ import annotations

import html.parser
import math
import os
import random
import re
import shutil
import struct
import subprocess
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from ettr.accounting import EttReport, compute
from ettr.errors import UsageError
from ettr.events import SUPERVISOR_RANK, Bucket, Event, EventKind, Phase
from ettr.report.html import render_html, run_names, write_html
from ettr.report.startup_charts import pieces_between, recoveries, tts_window
from ettr.report.svg import BUCKET_COLORS, fmt_s

T0 = 1_700_000_000.0
EVIL = "<script>alert('x')</script> & \"quoted\""


@dataclass
class Job:
    """A job's events written as a story, with times as offsets from T0 (a cursor `t` moves forward)."""

    events: list[Event] = field(default_factory=list)
    t: float = 0.0

    def sup(self, kind: EventKind, attempt: int = 0, **data) -> None:
        self.events.append(Event(kind, T0 + self.t, attempt, SUPERVISOR_RANK, data=data or None))

    def ev(self, kind: EventKind, attempt: int, **fields) -> None:
        self.events.append(Event(kind, T0 + self.t, attempt, 0, **fields))

    def phase(self, attempt: int, phase: Phase, duration_s: float, *, advance: bool = True) -> None:
        begin = self.t
        self.events.append(Event(EventKind.PHASE_BEGIN, T0 + begin, attempt, 0, phase=phase))
        self.events.append(
            Event(EventKind.PHASE_END, T0 + begin + duration_s, attempt, 0, phase=phase, value=T0 + begin)
        )
        if advance:
            self.t += duration_s

    def train(self, attempt: int, first: int, last: int, *, step_s: float, ckpt_every: int, block_s: float,
              recompile_at: int | None = None, reason: str = "") -> None:  # fmt: skip
        for n in range(first, last + 1):
            self.t += step_s
            self.ev(EventKind.STEP, attempt, step=n)
            if n == recompile_at:
                self.ev(EventKind.RECOMPILE, attempt, data={"reason": reason, "code": "model.py:42 forward"})
                self.phase(attempt, Phase.COMPILE, 3.0)
            if n % ckpt_every == 0:
                self.phase(attempt, Phase.CHECKPOINT_BLOCKING, block_s)
                self.phase(attempt, Phase.CHECKPOINT_PERSIST, 4.0, advance=False)  # overlaps training
                commit_ts = T0 + self.t + 4.0
                self.events.append(
                    Event(
                        EventKind.CHECKPOINT_COMMIT, commit_ts, attempt, 0, step=n, data={"path": f"ckpt/{n}"}
                    )
                )

    def startup(self, attempt: int, *, compile_s: float, restore_from: int | None) -> None:
        self.sup(EventKind.ATTEMPT_START, attempt, pid=100 + attempt)
        self.t += 1.0
        self.ev(EventKind.PROCESS_START, attempt, data={"pid": 100 + attempt, "world_size": 1})
        self.phase(attempt, Phase.DEVICE_INIT, 2.0)
        self.phase(attempt, Phase.PROCESS_GROUP_INIT, 3.0)
        self.phase(attempt, Phase.TRAIN_MODULE_CREATION, 6.0)
        if restore_from is not None:
            self.phase(attempt, Phase.RESTORE, 5.0)
            self.ev(EventKind.RESUMED, attempt, step=restore_from)
        # Compile and the first batch overlap: the data wait begins before compile ends.
        self.phase(attempt, Phase.COMPILE, compile_s, advance=False)
        self.t += compile_s * 0.6
        self.phase(attempt, Phase.DATA_WAIT, compile_s * 0.6)

    def report(self, job_id: str) -> EttReport:
        return compute(list(self.events), max(e.ts for e in self.events), job_id=job_id)


def baseline_job(job_id: str = "baseline") -> EttReport:
    return baseline_events(job_id).report(job_id)


def baseline_events(job_id: str = "baseline") -> Job:
    """Three attempts: a crash at step 55 (resume from 40), a preemption at step 95 (resume from 80), done."""
    j = Job()
    j.sup(EventKind.JOB_SUBMITTED)
    j.t = 40.0
    j.sup(EventKind.JOB_ALLOCATED)
    j.t = 52.0
    j.sup(EventKind.SUPERVISOR_START, pid=1, job_id=job_id)
    j.startup(0, compile_s=40.0, restore_from=None)
    j.train(0, 1, 55, step_s=1.0, ckpt_every=20, block_s=6.0, recompile_at=30, reason=EVIL)
    j.ev(EventKind.FAILURE, 0, data={"exception": "RuntimeError", "message": EVIL})
    j.t += 0.5
    j.sup(EventKind.ATTEMPT_END, 0, outcome="failed", exit_code=1)
    j.t += 8.0
    j.startup(1, compile_s=30.0, restore_from=40)
    j.train(1, 41, 95, step_s=1.0, ckpt_every=20, block_s=6.0, recompile_at=70, reason="dynamic shape: batch")
    j.t += 0.5
    j.sup(EventKind.ATTEMPT_END, 1, outcome="preempted", exit_code=143, signal="SIGTERM")
    j.t += 20.0
    j.startup(2, compile_s=30.0, restore_from=80)
    j.train(2, 81, 140, step_s=1.0, ckpt_every=20, block_s=6.0)
    j.phase(2, Phase.EVAL, 4.0)  # the final validation: evaluation, though in the completed job's tail
    j.phase(2, Phase.SHUTDOWN, 5.0)
    j.sup(EventKind.ATTEMPT_END, 2, outcome="completed", exit_code=0)
    j.t += 1.0
    j.sup(EventKind.JOB_END, exit_status=0)
    return j


def optimized_job(job_id: str = "optimized") -> EttReport:
    """Same training, warm compile cache and overlapped checkpoints; one crash, recovered quickly."""
    j = Job()
    j.sup(EventKind.JOB_SUBMITTED)
    j.t = 40.0
    j.sup(EventKind.JOB_ALLOCATED)
    j.t = 52.0
    j.sup(EventKind.SUPERVISOR_START, pid=1, job_id=job_id)
    j.startup(0, compile_s=6.0, restore_from=None)
    j.train(0, 1, 75, step_s=1.0, ckpt_every=10, block_s=0.4)
    j.t += 0.5
    j.sup(EventKind.ATTEMPT_END, 0, outcome="failed", exit_code=-9, signal="SIGKILL")
    j.t += 2.0
    j.startup(1, compile_s=5.0, restore_from=70)
    j.train(1, 71, 140, step_s=1.0, ckpt_every=10, block_s=0.4)
    j.phase(1, Phase.SHUTDOWN, 2.0)
    j.sup(EventKind.ATTEMPT_END, 1, outcome="completed", exit_code=0)
    j.t += 1.0
    j.sup(EventKind.JOB_END, exit_status=0)
    return j.report(job_id)


class _Doc(html.parser.HTMLParser):
    """The parts of a page the tests look at: tags, attributes, text, and the legend's buckets."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.texts: list[str] = []
        self._legend_depth = 0
        self.legend_buckets: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if self._legend_depth or "legend" in (a.get("class") or "").split():
            self._legend_depth += 1
            if a.get("data-bucket"):
                self.legend_buckets.append(a["data-bucket"] or "")

    def handle_endtag(self, tag: str) -> None:
        if self._legend_depth:
            self._legend_depth -= 1

    def handle_data(self, data: str) -> None:
        self.texts.append(data)

    def count(self, tag: str, cls: str | None = None) -> int:
        return sum(
            1 for t, a in self.tags if t == tag and (cls is None or cls in (a.get("class") or "").split())
        )


@pytest.fixture(scope="module")
def two_runs() -> list[EttReport]:
    return [baseline_job(), optimized_job()]


# -- the page as HTML -------------------------------------------------------------------------------------
def test_scripted_jobs_exercise_failures_overlaps_and_recompiles(two_runs):
    base, opt = two_runs
    assert base.num_failures == 2 and len(base.ttr_s) == 2 and len(base.recompiles) == 2
    assert opt.num_failures == 1 and opt.ett_pct > base.ett_pct
    first = base.attempts[0]  # compile and the first batch overlap: raw phases exceed their buckets
    raw_s = first.phases_s["compile"] + first.phases_s["data_wait"]
    assert raw_s > first.buckets_s[Bucket.COMPILE] + first.buckets_s[Bucket.DATA_WAIT] + 1.0
    assert all(base.buckets_s[b] > 0 for b in Bucket if b is not Bucket.OTHER)


def test_every_bucket_is_in_the_legend_with_its_colour(two_runs):
    text = render_html(two_runs[:1])
    doc = _Doc(text)
    assert sorted(doc.legend_buckets) == sorted(b.value for b in Bucket)
    assert len(set(BUCKET_COLORS.values())) == len(Bucket)  # one colour each
    for b in Bucket:
        assert f'style="background:{BUCKET_COLORS[b]}"></span>{b.value.replace("_", " ")}' in text


def test_text_from_the_ledger_is_escaped():
    j = baseline_job(job_id=EVIL)
    text = render_html([j])
    doc = _Doc(text)
    assert doc.count("script") == 1  # only the page's own script
    assert "<script>alert" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quoted&quot;" in text
    joined = "".join(doc.texts)
    assert EVIL in joined  # the job id, the failure message and the recompile reason read back as written
    for tag, attrs in doc.tags:
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name)  # no event handler smuggled into an attribute
            assert "alert" not in (value or "") or tag == "svg", (tag, name, value)


def test_output_is_deterministic(two_runs):
    first = render_html(two_runs)
    assert render_html(two_runs) == first
    # The same job from its events in another order gives the same page.
    shuffled = list(baseline_events().events)
    random.Random(7).shuffle(shuffled)
    again = compute(shuffled, max(e.ts for e in shuffled), job_id="baseline")
    assert render_html([again, two_runs[1]]) == first


def test_single_run_has_no_comparison_and_all_sections(two_runs):
    doc = _Doc(render_html(two_runs[:1]))
    ids = [a.get("id") for t, a in doc.tags if t == "section"]
    assert ids == ["headline", "timeline", "buckets", "tts", "ttr", "attempts", "recompiles"]
    assert doc.count("table", "compare") == 0
    # charts: headline bar, timeline, bucket bars, TTS waterfall, raw phases, TTR, one mini bar per attempt
    assert doc.count("svg", "chart") == 6 + len(two_runs[0].attempts)


def test_comparison_shows_both_runs_and_the_ett_delta(two_runs):
    base, opt = two_runs
    text = render_html(two_runs)
    doc = _Doc(text)
    assert doc.count("table", "compare") == 1
    delta = f"{opt.ett_pct - base.ett_pct:+.1f} pp"
    assert delta in text and f"{opt.ett_pct:.1f}%" in text and f"{base.ett_pct:.1f}%" in text
    assert re.search(r'<td class="good">' + re.escape(delta) + "</td>", text)
    # Each run has its own timeline, all on one axis: the longer job spans the full width.
    timelines = [m for m in re.findall(r'aria-label="timeline of ([^"]+)"', text)]
    assert timelines == ["baseline", "optimized"]
    assert run_names([base, base]) == ["baseline", "baseline (2)"]


def test_tts_waterfall_adds_up_to_the_tts(two_runs):
    base = two_runs[0]
    origin, end = tts_window(base)
    pieces = pieces_between(base, origin, end)
    assert math.isclose(sum(p.duration_s for p in pieces), base.tts_s, abs_tol=1e-6)
    assert [p.bucket for p in pieces][:3] == [Bucket.HARDWARE_SETUP, Bucket.INIT, Bucket.COMPILE]
    assert all(a.end_ts == pytest.approx(b.start_ts) for a, b in zip(pieces, pieces[1:], strict=False))
    assert "time to start" in render_html([base])


def test_ttr_bars_are_matched_to_their_failures(two_runs):
    base = two_runs[0]
    recs = recoveries(base)
    assert [r.failed.index for r in recs] == [0, 1]
    assert [r.ttr_s for r in recs] == list(base.ttr_s)
    text = render_html([base])
    assert "after #0 failed" in text and "after #1 preempted" in text


def test_charts_draw_the_windows_the_report_carries(two_runs):
    from ettr.report.json import to_dict

    base = two_runs[0]
    assert tts_window(base) == (base.tts_window.origin_ts, base.tts_window.training_start_ts)
    assert base.tts_window.duration_s == base.tts_s and base.tts_window.attempt == 0
    assert recoveries(base) == list(base.recoveries)
    out = to_dict(base)
    assert out["tts_window"]["training_start_ts"] - out["tts_window"]["origin_ts"] == base.tts_s
    assert [r["ttr_s"] for r in out["recoveries"]] == list(base.ttr_s)
    assert [(r["failed_attempt"], r["outcome"], r["recovered_attempt"]) for r in out["recoveries"]] == [
        (0, "failed", 1),
        (1, "preempted", 2),
    ]


def test_attempt_table_lists_every_attempt(two_runs):
    base = two_runs[0]
    text = render_html([base])
    table = text[text.index('<table class="attempts">') :]
    table = table[: table.index("</table>")]
    rows = re.findall(r"<tr><td>(\d+)</td>", table)
    assert rows == ["0", "1", "2"]
    assert ">preempted<" in table and "SIGTERM" in table and "<td>143</td>" in table
    assert f"<td>{base.attempts[1].resumed_from_step}</td>" in table


def test_degenerate_reports_render():
    empty = compute([], T0, job_id="empty")
    live = compute([Event(EventKind.PHASE_BEGIN, T0, 0, 0, phase=Phase.INIT)], T0 + 5, job_id="live")
    text = render_html([empty, live])
    assert "No attempt reached its first training step" in text and "in progress" in text
    with pytest.raises(ValueError):
        render_html([])


def test_write_html_writes_atomically_and_reports_bad_paths(tmp_path, two_runs):
    out = tmp_path / "report.html"
    write_html(two_runs, out)
    assert out.read_text(encoding="utf-8") == render_html(two_runs)
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    with pytest.raises(UsageError, match="cannot write the HTML report"):
        write_html(two_runs, tmp_path / "missing" / "report.html")


# -- the page in a real browser ---------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"


def _chromium() -> str:
    path = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    if path:
        return path
    if os.geteuid() == 0:  # CI runs as root and installs chromium (Makefile); its absence there is a failure
        pytest.fail("chromium is not installed; `make test` installs it with apt-get when run as root")
    pytest.skip("chromium is not installed (and not root to install it)")


def _run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / "profile"
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def _png_rgb(data: bytes) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into an (h, w, 3) array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    assert header is not None
    width, height, depth, color_type, _, _, interlace = header
    assert depth == 8 and color_type in (2, 6) and interlace == 0, header
    bpp = 3 if color_type == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), dtype=np.uint8)
    prev = np.zeros(width * bpp, dtype=np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) & 0xFF
        elif kind == 1:  # Sub: a running sum per channel
            cur = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) & 0xFF
        else:  # Average / Paeth: sequential by nature
            cur = np.zeros_like(line)
            for i in range(line.size):
                left = cur[i - bpp] if i >= bpp else 0
                up = prev[i]
                if kind == 3:
                    cur[i] = (line[i] + ((left + up) >> 1)) & 0xFF
                else:
                    up_left = prev[i - bpp] if i >= bpp else 0
                    p = left + up - up_left
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                    pred = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
                    cur[i] = (line[i] + pred) & 0xFF
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)[:, :, :3]


def _has_colour(rgb: np.ndarray, hex_colour: str, *, min_pixels: int) -> bool:
    target = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    close = np.all(np.abs(rgb.astype(np.int16) - target) <= 6, axis=-1)
    return int(close.sum()) >= min_pixels


@pytest.mark.slow
def test_report_renders_in_headless_chromium(tmp_path, two_runs):
    page = tmp_path / "report.html"
    write_html(two_runs, page)
    url = page.as_uri()

    dom = _run_chromium(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console_errors(dom.stderr) == []
    doc = _Doc(dom.stdout)
    root = next(a for t, a in doc.tags if t == "html")
    assert root.get("data-ettr-script") == "ok"  # the inline script ran to its end
    assert doc.count("svg", "chart") >= 8
    assert sum(1 for t, a in doc.tags if t == "rect" and a.get("data-bucket") == "effective_training") > 3

    shot = tmp_path / "shot.png"
    result = _run_chromium(
        tmp_path, f"--screenshot={shot}", "--window-size=1200,1600", "--hide-scrollbars", url
    )
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    rgb = _png_rgb(shot.read_bytes())
    assert rgb.shape[:2] == (1600, 1200)
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 50  # not blank
    # The headline bars and the timelines paint: effective training green, failure red, start-up blue.
    for bucket in (Bucket.EFFECTIVE_TRAINING, Bucket.WASTED_PROGRESS, Bucket.INIT, Bucket.RESTART):
        assert _has_colour(rgb, BUCKET_COLORS[bucket], min_pixels=200), bucket
    if os.environ.get("ETTR_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["ETTR_KEEP_SCREENSHOT"])


@pytest.mark.slow
def test_browser_check_sees_script_errors(tmp_path):
    """The check above can fail: a page whose script throws is caught by both signals."""
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><body><p>x</p><script>undefinedFunction();"
        "document.documentElement.setAttribute('data-ettr-script','ok');</script></body></html>",
        encoding="utf-8",
    )
    dom = _run_chromium(tmp_path, "--dump-dom", page.as_uri())
    assert 'data-ettr-script="ok"' not in dom.stdout
    assert any("undefinedFunction" in line for line in _console_errors(dom.stderr)), dom.stderr[-2000:]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (0.004, "0.00 s"),
        (9.996, "10.0 s"),
        (42.04, "42.0 s"),
        (139.9996, "2m 20s"),
        (7325, "2h 02m"),
    ],
)
def test_durations_read_as_people_write_them(seconds, text):
    assert fmt_s(seconds) == text


def test_a_requeued_runs_wait_is_drawn_as_recovery() -> None:
    # Attempt 0 preempted at 10; the requeued run was submitted at 11, allocated at 17, its supervisor up at
    # 20: attempt 1's `scheduling` is failure (what the preemption cost), hatched like a later start-up.
    from ettr.report.charts import counts_as_recovery, timeline_svg

    def ev(kind: EventKind, t: float, attempt: int = 0, rank: int = SUPERVISOR_RANK, **kw) -> Event:
        return Event(kind, T0 + t, attempt, rank, **kw)

    events = [
        ev(EventKind.JOB_SUBMITTED, 0),
        ev(EventKind.JOB_ALLOCATED, 2),
        ev(EventKind.SUPERVISOR_START, 3),
        ev(EventKind.ATTEMPT_START, 4),
        *(ev(EventKind.STEP, 5 + i, rank=0, step=i + 1) for i in range(4)),
        ev(EventKind.CHECKPOINT_COMMIT, 8.5, rank=0, step=4),
        ev(EventKind.ATTEMPT_END, 10, data={"outcome": "preempted", "exit_code": 143}),
        ev(EventKind.SUPERVISOR_START, 20, 0, data={"submitted_at": T0 + 11, "allocated_at": T0 + 17}),
        ev(EventKind.ATTEMPT_START, 21, 1),
        ev(EventKind.RESUMED, 21.5, 1, rank=0, step=4),
        *(ev(EventKind.STEP, 23 + i, 1, rank=0, step=5 + i) for i in range(2)),
        ev(EventKind.ATTEMPT_END, 25, 1, data={"outcome": "completed", "exit_code": 0}),
        ev(EventKind.JOB_END, 25, 1, data={"exit_status": 0}),
    ]
    report = compute(events, T0 + 25)
    assert report.attempts[1].buckets_s[Bucket.SCHEDULING] == pytest.approx(6)
    assert counts_as_recovery(Bucket.SCHEDULING, 1) and not counts_as_recovery(Bucket.SCHEDULING, 0)
    assert not counts_as_recovery(Bucket.RESTART, 1)  # failure in any attempt: its own colour says so
    svg = timeline_svg(report)
    titles = re.findall(r"<title>([^<]*)</title>", svg)
    later = [t for t in titles if t.startswith("attempt 1 · ") and "scheduling" in t.lower()]
    first = [t for t in titles if t.startswith("attempt 0 · ") and "scheduling" in t.lower()]
    assert later and all("counted as failure (recovery)" in t for t in later), titles
    assert first and not any("counted as failure" in t for t in first), titles


def test_an_attempt_with_no_exit_status_is_titled_so_not_exit_code_none():
    # An exception a worker survived and that was recovered in place: no process exited (exit_code null).
    from ettr.report.charts import timeline_svg

    def ev(kind: EventKind, t: float, attempt: int = 0, rank: int = SUPERVISOR_RANK, **kw) -> Event:
        return Event(kind, T0 + t, attempt, rank, **kw)

    events = [
        ev(EventKind.SUPERVISOR_START, 0),
        ev(EventKind.ATTEMPT_START, 1),
        *(ev(EventKind.STEP, 2 + i, rank=0, step=i + 1) for i in range(3)),
        ev(
            EventKind.ATTEMPT_END,
            5,
            data={"outcome": "failed", "exit_code": None, "exception": "RuntimeError"},
        ),
        ev(EventKind.ATTEMPT_START, 5, 1),
        *(ev(EventKind.STEP, 6 + i, 1, rank=0, step=4 + i) for i in range(2)),
        ev(EventKind.ATTEMPT_END, 8, 1, data={"outcome": "completed", "exit_code": 0}),
        ev(EventKind.JOB_END, 8, 1, data={"exit_status": 0}),
    ]
    titles = re.findall(r"<title>([^<]*)</title>", timeline_svg(compute(events, T0 + 8)))
    assert any(t.startswith("attempt 0: failed, no exit code,") for t in titles), titles
    assert not any("exit code None" in t for t in titles), titles


def test_terminal_escapes_from_the_ledger_are_written_as_escapes():
    """A job id or failure message holding an escape sequence (OSC 52 sets the clipboard of a terminal that
    `cat`s the page; BEL and ESC are not characters XML allows) reads as its escape, as in the text report;
    styling (`\x1b[31m`) is dropped (`untrusted.printable`)."""
    forged = "j1\x1b]52;c;ZXZpbA==\x07\x1b[31m\x9b2J\u202e"
    text = render_html([baseline_job(job_id=forged)])
    assert not any(c in text for c in "\x1b\x07\x9b\u202e")
    assert "j1\\x1b]52;c;ZXZpbA==\\x07\\x9b2J\\u202e" in text

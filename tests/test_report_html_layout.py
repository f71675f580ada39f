"""The HTML report reads at 1,280 px: tables fit their cards, an attempt's details get a full-width row, and
runs are labelled by their run directories' names (job ids look alike). Measured in headless Chromium by a
probe script added to the page, which writes what the browser laid out into the DOM that `--dump-dom` prints."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from ettr.cli import main
from ettr.ledger import open_ledger
from ettr.report.html import render_html, run_names
from ettr.report.labels import run_labels
from test_report_html import _console_errors, _run_chromium, baseline_job, optimized_job

LONG_IDS = ("demo-baseline-20261130-093112-4f2a9c", "demo-optimized-20261130-093112-4f2b1d")
PROBE = """<script>(function () {
  var out = {tables: [], details: []};
  document.querySelectorAll("table").forEach(function (t) {
    var card = t.closest("section"), pad = parseFloat(getComputedStyle(card).paddingRight);
    out.tables.push({cls: t.className, right: t.getBoundingClientRect().right,
                     card_right: card.getBoundingClientRect().right - pad});
  });
  document.querySelectorAll("table.attempts tr.details td").forEach(function (td) {
    out.details.push(td.getBoundingClientRect().width);
  });
  out.body = document.documentElement.clientWidth;
  document.documentElement.setAttribute("data-probe", JSON.stringify(out));
})();</script>"""


def _layout(tmp_path: Path, page_html: str) -> dict:
    page = tmp_path / "page.html"
    page.write_text(page_html.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    done = _run_chromium(
        tmp_path, "--window-size=1280,2400", "--hide-scrollbars", "--dump-dom", page.as_uri()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert _console_errors(done.stderr) == []
    found = re.search(r'data-probe="([^"]*)"', done.stdout)
    assert found, "the probe script did not run"
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.slow
@pytest.mark.parametrize("labels", [None, ["baseline", "optimized"]])
def test_tables_fit_their_cards_at_1280_px(tmp_path: Path, labels: list[str] | None) -> None:
    reports = [baseline_job(LONG_IDS[0]), optimized_job(LONG_IDS[1])]
    layout = _layout(tmp_path, render_html(reports, labels=labels))
    assert layout["body"] == 1280
    assert {t["cls"] for t in layout["tables"]} >= {"compare", "attempts", "recompiles"}
    for table in layout["tables"]:
        assert table["right"] <= table["card_right"] + 1, table  # was 450 px past its card (compare)
    # Every attempt that did not complete has its details, each as wide as the table (was ~80 px).
    assert len(layout["details"]) == 3
    assert min(layout["details"]) >= 600, layout["details"]


def test_runs_are_labelled_by_their_run_directories() -> None:
    reports = [baseline_job(LONG_IDS[0]), optimized_job(LONG_IDS[1])]
    text = render_html(reports, labels=["baseline", "optimized"])
    assert re.findall(r"<h3>([^<]+)</h3>", text)[:2] == ["baseline", "optimized"]
    assert "<th>Δ optimized vs baseline</th>" in text
    assert "<b>baseline</b> · job demo-baseline-20261130-093112-4f2a9c" in text  # the id stays in the header
    assert run_names(reports, ["x", "x"]) == ["x", "x (2)"]
    with pytest.raises(ValueError):
        run_names(reports, ["only one"])


def test_run_labels_are_short_and_tell_directories_apart(tmp_path: Path) -> None:
    assert run_labels(["runs/baseline", "runs/optimized"]) == ["baseline", "optimized"]
    assert run_labels(["a/x/job", "b/x/job", "c"]) == ["a/x/job", "b/x/job", "c"]
    assert run_labels(["runs/job/", "runs/./other/../job"]) == ["job", "job"]  # the same directory twice
    assert run_labels([tmp_path / "one"]) == ["one"]
    assert run_labels(["."]) == [Path.cwd().name or "/"]


def test_cli_html_comparison_uses_run_directory_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_report_html import baseline_events

    dirs = []
    for side in ("baseline", "optimized"):
        run_dir = tmp_path / side / "run"
        run_dir.mkdir(parents=True)
        ledger = open_ledger(run_dir, create=True)
        ledger.append(baseline_events(f"demo-{side}-20261130-093112").events)
        ledger.close()
        dirs.append(str(run_dir))
    out = tmp_path / "report.html"
    assert main(["report", *dirs, "--html", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert re.findall(r"<h3>([^<]+)</h3>", text)[:2] == ["baseline/run", "optimized/run"]
    table = capsys.readouterr().out
    assert "baseline/run" in table and "optimized/run" in table

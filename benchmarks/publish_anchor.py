"""The training job's PUBLISH phase with the anchor written vs made from the final checkpoint (hard links).

Runs the reference job (`examples/dlrm/train.py`: 2 ranks under `ettr run -- torchrun`, TorchRec tables
sharded over gloo, ettr's async checkpoints with raw records, `--publish standalone`, `--fast-exit`) twice per
repeat, alternating: `--publish-anchor written` (the anchor is a second DCP write of the model, as before)
and `--publish-anchor linked` (the anchor's data files are the final checkpoint's, hard-linked, every tensor
read back and compared first: `ettr.publish.linked_anchor`). Each job's PUBLISH phase (forward on the sample,
anchor, enqueue) is read from its ledger, per rank; medians are printed. `--json` ends with one object:
written_publish_phase_s, linked_publish_phase_s (rank 0's, medians), saved_s, written_publish_phase_max_s,
linked_publish_phase_max_s (the slower rank's), num_linked (linked jobs whose anchor was linked, not
written after a fallback), num_repeats, model_bytes, load_before, load_after.

    python benchmarks/publish_anchor.py [--repeats 3] [--steps 40] [--num-rows 50000] [--json] [--quick]

`--quick` (what CI runs): one pair, 12 steps, 2,000 rows a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "dlrm" / "train.py"


def _publish_phases(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> {seconds, data} of the PUBLISH phase in the job's ledger."""
    db = sqlite3.connect(f"file:{run_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        columns = [row[1] for row in db.execute("pragma table_info(events)")]
        found: dict[int, dict[str, Any]] = {}
        for values in db.execute("select * from events"):
            event = dict(zip(columns, values, strict=True))
            if str(event.get("kind")).lower() == "phase_end" and str(event.get("phase")).lower() == "publish":
                found[int(event["rank"])] = {
                    "seconds": event["ts"] - event["value"],
                    "data": json.loads(event["data"]) if event.get("data") else {},
                }
        return found
    finally:
        db.close()


def one_run(work: Path, anchor: str, index: int, args: argparse.Namespace) -> dict[str, Any]:
    base = work / f"{anchor}-{index}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETTR_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    command = [
        sys.executable, "-m", "ettr.cli", "run", "--run-dir", str(base / "run"), "--job-id", f"anchor-{anchor}-{index}",
        "--max-restarts", "0", "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "2", str(TRAIN), "--steps", str(args.steps), "--ckpt-every", str(max(1, args.steps // 2)),
        "--ckpt-mode", "ettr", "--ckpt-dir", str(base / "ckpt"), "--publish", "standalone",
        "--publish-dir", str(base / "publish"), "--publish-anchor", anchor, "--no-compile",
        "--num-rows", str(args.num_rows), "--fast-exit", "--log-every", str(args.steps),
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(
            f"the {anchor} job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    phases = _publish_phases(base / "run")
    if 0 not in phases:
        raise SystemExit(f"the {anchor} job recorded no PUBLISH phase on rank 0 ({base / 'run'})")
    return {
        "anchor": anchor,
        "rank0_s": phases[0]["seconds"],
        "max_s": max(p["seconds"] for p in phases.values()),
        "made": phases[0]["data"].get("anchor_made"),
        "fallback": phases[0]["data"].get("anchor_fallback", ""),
        "linked_bytes": phases[0]["data"].get("linked_bytes"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs of jobs (medians are printed)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per job")
    parser.add_argument("--num-rows", type=int, default=50000, help="rows per table (12 tables, as the demo)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    parser.add_argument("--quick", action="store_true", help="one small pair (CI's check)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.num_rows = 1, 12, 2000
    if args.repeats < 1 or args.steps < 2 or args.num_rows < 1:
        parser.error("--repeats and --num-rows must be >= 1, --steps >= 2")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ettr-anchor-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    for index in range(args.repeats):
        for anchor in ("written", "linked") if index % 2 == 0 else ("linked", "written"):
            row = one_run(work, anchor, index, args)
            rows.append(row)
            print(
                f"run {index} {anchor:7s} publish phase rank 0 {row['rank0_s']:.3f} s, slower rank "
                f"{row['max_s']:.3f} s, anchor {row['made']}"
                + (f" ({row['fallback']})" if row["fallback"] else "")
                + f"  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )

    def median(anchor: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["anchor"] == anchor)

    linked_rows = [r for r in rows if r["anchor"] == "linked"]
    figures = {
        "written_publish_phase_s": median("written", "rank0_s"),
        "linked_publish_phase_s": median("linked", "rank0_s"),
        "saved_s": median("written", "rank0_s") - median("linked", "rank0_s"),
        "written_publish_phase_max_s": median("written", "max_s"),
        "linked_publish_phase_max_s": median("linked", "max_s"),
        "num_linked": sum(1 for r in linked_rows if r["made"] == "linked"),
        "num_repeats": args.repeats,
        "model_bytes": next((r["linked_bytes"] for r in linked_rows if r["linked_bytes"]), None),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "quick": args.quick,
    }
    print(
        f"\nPUBLISH phase, rank 0, median of {args.repeats} (load {load_before:.1f} -> {figures['load_after']:.1f}): "
        f"written {figures['written_publish_phase_s']:.3f} s, linked {figures['linked_publish_phase_s']:.3f} s "
        f"({figures['saved_s']:+.3f} s saved); slower rank {figures['written_publish_phase_max_s']:.3f} s -> "
        f"{figures['linked_publish_phase_max_s']:.3f} s; {figures['num_linked']} of {len(linked_rows)} linked"
    )
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())

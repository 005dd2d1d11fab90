"""Compare runs: held-out accuracy (greedy) per step from each run folder's metrics.jsonl + summary.json.

python scripts/plot_runs.py --out docs/compare.png runs/a:"label a" runs/b:"label b"
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import curve_rows, plot  # noqa: E402


def curve(run: str) -> tuple[list[int], list[float]]:
    """(steps, accuracies) of a run's held-out evaluations; step 0 (before training) from summary.json."""
    summary = os.path.join(run, "summary.json")
    before = json.load(open(summary))["acc_before"] if os.path.exists(summary) else float("nan")
    rows = [
        r for r in curve_rows(os.path.join(run, "metrics.jsonl"), before) if "eval/accuracy" in r
    ]
    return [r["step"] for r in rows], [r["eval/accuracy"] for r in rows]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="RUN_DIR or RUN_DIR:label")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    lines = []
    for spec in a.runs:
        run, _, label = spec.partition(":")
        lines.append((*curve(run), "o-", label or os.path.basename(run.rstrip("/"))))
    plot(lines, a.out, ylabel="held-out accuracy (greedy)", title=a.title)
    print(a.out)

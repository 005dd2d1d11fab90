"""Compare runs: held-out accuracy (greedy) per step from each run folder's metrics.jsonl + summary.json.

    python scripts/plot_runs.py --out docs/compare.png runs/a:"label a" runs/b:"label b"
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import plot  # noqa: E402


def curve(run: str) -> tuple[list[int], list[float]]:
    """(steps, accuracies): step 0 and the final value come from summary.json, the rest from metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    pts = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    summary = os.path.join(run, "summary.json")
    if os.path.exists(summary):
        s = json.load(open(summary))
        pts.update({0: s["acc_before"], rows[-1]["step"]: s["acc_after"]})
    steps = sorted(pts)
    return steps, [pts[k] for k in steps]


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

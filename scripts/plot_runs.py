"""Compare runs: held-out accuracy (greedy) per step from each run folder's metrics.jsonl + summary.json.

python scripts/plot_runs.py --out docs/compare.png runs/a:"label a" runs/b:"label b"
python scripts/plot_runs.py --out docs/sft_then_rl.png runs/sft+runs/sft_rl:"SFT, then RL" runs/rl:"RL"

A run given as RUN+NEXT (a stage two started from RUN's final/) is one curve: NEXT's steps continue RUN's.
"""

import argparse
import json
import os

import repo  # noqa: F401  (puts the project root on sys.path)
from common import curve_rows, plot


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
    ap.add_argument("runs", nargs="+", help="RUN_DIR[+NEXT_DIR...][:label]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    lines = []
    for spec in a.runs:
        chain, _, label = spec.partition(":")
        steps = []
        accs = []
        for run in chain.split("+"):
            more_steps, more_accs = curve(run)
            if steps:  # a stage two: its step 0 is the previous stage's last evaluation
                more_steps = [steps[-1] + x for x in more_steps[1:]]
                more_accs = more_accs[1:]
            steps += more_steps
            accs += more_accs
        lines.append((steps, accs, "o-", label or os.path.basename(chain.rstrip("/"))))
    plot(lines, a.out, ylabel="held-out accuracy (greedy)", title=a.title)
    print(a.out)

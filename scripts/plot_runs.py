"""Compare runs: held-out accuracy (greedy) per step from each run folder's metrics.jsonl + summary.json.

    python scripts/plot_runs.py --out docs/compare.png runs/a:"label a" runs/b:"label b"
"""
import argparse
import json
import os


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


def curve_rows(metrics_path: str, acc_before: float) -> list[dict]:
    """Step 0 (the held-out accuracy before training) and every logged step, those before a resume too; a step logged
    twice (the run resumed from a checkpoint before it) by its last row."""
    with open(metrics_path) as f:
        logged = {r["step"]: r for r in map(json.loads, f)}
    first = {"step": 0, "reward/mean": float("nan"), "reward/accuracy": float("nan"), "eval/accuracy": acc_before}
    return [first] + [logged[s] for s in sorted(logged)]


def plot(lines: list[tuple], path: str, ylabel: str = "", title: str = ""):
    """One figure of (steps, values, style, label) lines over steps, saved at path (train.py's curve.png too)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for steps, values, style, label in lines:
        ax.plot(steps, values, style, label=label)
    ax.set(xlabel="step", ylabel=ylabel, ylim=(-0.02, 1.02), title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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

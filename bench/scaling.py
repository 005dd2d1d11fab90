"""Train-phase scaling (issue 46): the same global batch on 1 and 2 processes, each train.Config.fsdp
on 2. Last line: the 1-process train phase over the best 2-process one.

    OMP_NUM_THREADS=1 .venv/bin/python bench/scaling.py        # about 5 minutes on 2 idle cores

train.py under torchrun on the tiny Qwen2.5-VL and the color task (configs/tiny_cpu.yaml: 8 prompts
x 8, the HF sampler, no held-out set, nothing saved), one thread per process: each run's time/train
(train.train_phase: micro-batches, log-prob pass, advantages, optimizer step) over its steps after
`warmup`, the median; `rounds` > 1 interleaves the runs (other load drifts), their steps pooled.
"""

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
RUNS = [(1, "auto"), (2, "reshard"), (2, "keep"), (2, "replicate"), (2, "auto")]


@dataclass
class Config:
    steps: int = 8
    """train.py steps per run"""
    warmup: int = 2
    """the first steps left out (one-time costs)"""
    rounds: int = 1
    """runs of every setting, interleaved"""
    out: str = os.path.join(ROOT, ".cache/bench/scaling")
    """the runs' out_dirs"""


def run(c: Config, ranks: int, fsdp: str, k: int) -> list[float]:
    """One torchrun of train.py: time/train of each step after the warm-up."""
    out = os.path.join(c.out, f"{ranks}-{fsdp}-{k}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={ranks}", "train.py", "--config", "configs/tiny_cpu.yaml"]
    cmd += ["--rollout", "hf", "--val-data", "", "--no-save", "--out-dir", out]
    cmd += ["--max-steps", str(c.steps), "--fsdp", fsdp]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"{ranks} ranks, fsdp {fsdp} failed:\n{p.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["time/train"] for r in rows[c.warmup :]]


def auto_pick(ranks: int) -> str:
    """What train.load_model's fsdp_choice picks for the tiny model on `ranks` CPU processes."""
    import torch
    import train

    cfg = train.load_config(["--config", "configs/tiny_cpu.yaml"])
    model = train.load_model(cfg, torch.device("cpu"))
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    memory = train.device_memory(torch.device("cpu")) / ranks  # LOCAL_WORLD_SIZE ranks share it
    return train.fsdp_choice(cfg, total, trained, memory, False, ranks)


def main(c: Config):
    os.chdir(ROOT)
    times = {setting: [] for setting in RUNS}
    for k in range(c.rounds):
        for ranks, fsdp in RUNS:
            times[ranks, fsdp] += run(c, ranks, fsdp, k)
    load = os.getloadavg()[0]
    print(f"train phase, 8 prompts x 8, load average {load:.1f} on {os.cpu_count()} cores")
    print("| processes | fsdp | train phase (median) | steps |\n|---|---|---|---|")
    median = {}
    for (ranks, fsdp), xs in times.items():
        median[ranks, fsdp] = statistics.median(xs)
        print(f"| {ranks} | {fsdp} | {median[ranks, fsdp]:.3f} s | {len(xs)} |")
    best = min((m, fsdp) for (ranks, fsdp), m in median.items() if ranks == 2 and fsdp != "auto")
    print(f"best on 2 processes: {best[1]}; auto picks {auto_pick(2)}")
    print(f"train phase, 2 processes vs 1: {median[1, 'auto'] / best[0]:.2f}x")


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))

"""Train-phase scaling (issue 46): the same global batch on 1 and 2 processes, each train.Config.fsdp
on 2. Last line: the 1-process train phase over the best 2-process one.

    .venv/bin/python bench/scaling.py        # about 8 minutes on 2 idle cores

train.py under torchrun on the tiny Qwen2.5-VL and the color task (configs/tiny_cpu.yaml: 8 prompts
x 8, the HF sampler, no held-out set, nothing saved), the machine's cores split among the processes
(OMP_NUM_THREADS: 2 threads for one process, 1 each for two: both sides get the same 2-core machine):
each run's time/train (train.train_phase: micro-batches, log-prob pass, advantages, optimizer step)
over its steps after the first WARMUP, the median; each setting runs ROUNDS times, interleaved, and
keeps its fastest run's (the least slowed by other processes, as bench/memory.py: on the shared
2-core machine a run's speed follows the load around it; the load average is printed).
"""

import os
import statistics

from harness import ROOT, train

RUNS = [(1, "auto"), (2, "reshard"), (2, "keep"), (2, "replicate"), (2, "auto")]
STEPS = 8  # train.py steps per run
WARMUP = 2  # the first steps, left out (one-time costs)
ROUNDS = 3  # runs of each setting
OUT = os.path.join(ROOT, ".cache/bench/scaling")


def run(ranks: int, fsdp: str) -> float:
    """One torchrun of train.py: the median time/train of its steps after the warm-up."""
    out = os.path.join(OUT, f"{ranks}-{fsdp}")
    flags = ["--rollout", "hf", "--fsdp", fsdp]
    what = f"{ranks} ranks, fsdp {fsdp}"
    rows = train(ranks, out, STEPS, flags, what, OMP_NUM_THREADS=str(2 // ranks))
    return statistics.median([r["time/train"] for r in rows][WARMUP:])


def main():
    import train

    runs = [run(*setting) for _ in range(ROUNDS) for setting in RUNS]
    median = {setting: min(runs[k :: len(RUNS)]) for k, setting in enumerate(RUNS)}
    print(
        f"train phase, 8 prompts x 8, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"| processes | fsdp | train phase (median, fastest of {ROUNDS} runs) |\n|---|---|---|")
    for (ranks, fsdp), m in median.items():
        print(f"| {ranks} | {fsdp} | {m:.3f} s |")
    best = min((m, fsdp) for (ranks, fsdp), m in median.items() if ranks == 2 and fsdp != "auto")
    # tiny_cpu.yaml keeps the defaults fsdp auto, no offload; CPU ranks: train.load_model's memory
    auto = train.fsdp_choice(train.Config(), 0, float("inf"), False, 2)
    print(f"best on 2 processes: {best[1]}; auto picks {auto}")
    print(f"train phase, 2 processes vs 1: {median[1, 'auto'] / best[0]:.2f}x")


if __name__ == "__main__":
    main()

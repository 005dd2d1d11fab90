"""Several train.py runs one after another in the same torchrun processes: torchrun's start, the imports (~15 CPU s
for 2 ranks) and the process group are paid once. Each run's command line (train.py's arguments) is a group,
the groups separated by "--"; the tests start it with `launch` (or `launch_until_failure`: conftest's shared
launch, which starts the runs after a failed one again).

    torchrun --nproc_per_node=2 tests/train_worker.py --config A.yaml ... -- --config B.yaml ... --resume auto

Before each run, rank 0 prints MARK and the run's index: `launch` cuts each run's stdout there. After each run,
rank 0 copies its out_dir's metrics.jsonl to metrics.run<index>.jsonl (the next run may rewrite the file).
Several runs may sample with vLLM: each run's end closes its engine (VLLMEngine.close) keeping the process group,
and the next run builds its own (conftest's shared launch: test_train's, test_lora's, test_qwen3_video's runs).
"""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "=== train_worker run "


def launch(runs: list[list[str]], nproc: int = 2, timeout: float = 900) -> list[str]:
    """torchrun this file on `runs`; each run's stdout (from its MARK to the next), stderr appended to the last."""
    logs, p = launch_until_failure(runs, nproc, timeout)
    assert p.returncode == 0 and len(logs) == len(runs), p.stdout[-3000:] + p.stderr[-5000:]
    return logs


def launch_until_failure(runs: list[list[str]], nproc: int = 2,
                         timeout: float = 900) -> tuple[list[str], subprocess.CompletedProcess]:
    """torchrun this file on `runs`: the log of each run that started (as `launch`'s) and the finished launch. When
    it failed, the last run that started is the one that failed: rank 0 prints a run's MARK once the run before it
    has passed train.finish's closing barrier on both ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--max-restarts=0", os.path.abspath(__file__)]
    for k, args in enumerate(runs):
        cmd += ["--"] * (k > 0) + list(args)
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=timeout)
    logs = [p.stdout.partition(f"{MARK}{k}\n")[2].partition(f"{MARK}{k + 1}\n")[0]
            for k in range(len(runs)) if f"{MARK}{k}\n" in p.stdout]
    if logs:
        logs[-1] += p.stderr
    return logs, p


def main(argv: list[str]):
    sys.path.insert(0, ROOT)
    import train
    train.common.quiet()  # as train.py's own start-up
    runs = [[]]
    for a in argv:
        if a == "--":
            runs.append([])
        else:
            runs[-1].append(a)
    rank0 = os.environ.get("RANK", "0") == "0"
    for k, args in enumerate(runs):
        if rank0:
            print(f"{MARK}{k}", flush=True)
        cfg = train.load_config(args)
        train.main(cfg)
        metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
        if rank0 and os.path.exists(metrics):
            shutil.copy(metrics, os.path.join(cfg.out_dir, f"metrics.run{k}.jsonl"))


if __name__ == "__main__":
    main(sys.argv[1:])

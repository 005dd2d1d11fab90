"""Several train.py runs one after another in the same torchrun processes: torchrun's start, the imports (~15 CPU s
for 2 ranks) and the process group are paid once. Each run's command line (train.py's arguments) is a group,
the groups separated by "--"; the tests start it with `launch` (or `start`: conftest's shared launches).
A run whose first argument is a .py file of tests/ calls that module's worker() on the rest instead
(test_sp.py's SP worker; imported once).

    torchrun --nproc_per_node=2 tests/train_worker.py --config A.yaml ... -- --config B.yaml ... --resume auto
    torchrun --nproc_per_node=2 tests/train_worker.py tests/test_sp.py OUT DATA.jsonl 2 - qwen3_vl -- --config ...

Before each run, rank 0 prints MARK and the run's index (after the last, MARK and the number of runs): `start` cuts
each run's stdout there. After each run every rank flushes its stdout and passes a barrier: a run is finished once
the next MARK is printed. After each train.py run, rank 0 copies its out_dir's metrics.jsonl to
metrics.run<index>.jsonl (the next run may rewrite the file).
Several runs may sample with vLLM: each run's end closes its engine (VLLMEngine.close) keeping the process group,
and the next run builds its own (conftest's shared launch: test_train's, test_lora's, test_qwen3_video's runs).
"""

import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "=== train_worker run "


@dataclass
class Launch:
    """One torchrun launch of several runs."""

    logs: list[str]
    """each run's stdout, from its MARK to the next (the launch's stderr appended to the last run's)"""
    finished: int
    """how many runs rank 0 finished (the first ones): a run whose next MARK was printed"""
    stderr: str
    """the launch's stderr (every rank's)"""

    def log(self, k: int) -> str:
        """Run k's stdout; an AssertionError with that part of the output (and stderr's end) where run k did not
        finish: a test reading one run fails on its own run, not on a later one of the same launch."""
        assert k < self.finished, (
            f"run {k} did not finish: {self.logs[k][-3000:]}\n{self.stderr[-5000:]}"
        )
        return self.logs[k]


def start(runs: list[list[str]], nproc: int = 2, timeout: float = 900) -> Launch:
    """torchrun this file on `runs`, whatever its exit status; the tests check each run's part (Launch.log)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--max-restarts=0",
        os.path.abspath(__file__),
    ]
    for k, args in enumerate(runs):
        cmd += ["--"] * (k > 0) + list(args)
    p = subprocess.run(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    logs = [
        p.stdout.partition(f"{MARK}{k}\n")[2].partition(f"{MARK}{k + 1}\n")[0]
        for k in range(len(runs))
    ]
    logs[-1] += p.stderr
    finished = next((k for k in range(len(runs)) if f"{MARK}{k + 1}\n" not in p.stdout), len(runs))
    if (
        p.returncode != 0
    ):  # the processes may fail after the last MARK: no run counts as finished then
        finished = min(finished, len(runs) - 1)
    return Launch(logs, finished, p.stderr)


def launch(runs: list[list[str]], nproc: int = 2, timeout: float = 900) -> list[str]:
    """`start`, every run finished: each run's stdout (from its MARK to the next), stderr appended to the last."""
    result = start(runs, nproc, timeout)
    for k in range(len(runs)):
        result.log(k)
    return result.logs


def main(argv: list[str]):
    sys.path.insert(0, ROOT)
    import torch.distributed as dist

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
        if args[0].endswith(".py"):  # tests/ is on sys.path: this file's folder
            importlib.import_module(os.path.basename(args[0]).removesuffix(".py")).worker(*args[1:])
        else:
            cfg = train.load_config(args)
            train.main(cfg)
            metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
            if rank0 and os.path.exists(metrics):
                shutil.copy(metrics, os.path.join(cfg.out_dir, f"metrics.run{k}.jsonl"))
        sys.stdout.flush()  # every rank's lines of run k before the next MARK
        if dist.is_initialized():
            dist.barrier()
    if rank0:
        print(f"{MARK}{len(runs)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

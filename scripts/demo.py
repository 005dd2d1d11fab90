"""`make demo` runs this: build the tiny model and the synthetic videos if missing, train on this CPU, print the
result; the last line printed is exactly `held-out accuracy: before <a> after <b>`."""

import collections
import os
import shutil
import subprocess
import sys
import time

from repo import ROOT, torchrun

CONFIG = "configs/tiny_cpu.yaml"


def main():
    os.chdir(ROOT)
    import make_synthetic_data
    import make_tiny_model

    t0 = time.time()
    make_tiny_model.ensure("qwen2_5_vl")  # .cache/models/tiny-qwen2_5_vl
    make_synthetic_data.make(
        ".cache/data/color", ["color"], num_train=512
    )  # 64 val; 56x56, 4 fps, 2 s
    print(f"tiny model and synthetic videos ready ({time.time() - t0:.0f}s)", flush=True)
    shutil.rmtree("runs/tiny_cpu", ignore_errors=True)  # a fresh run every time
    env = dict(
        os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"
    )  # vLLM's CPU KV cache: rollout.py
    cmd = torchrun(2, "train.py", "--config", CONFIG)
    print(f"$ torchrun --nproc_per_node=2 train.py --config {CONFIG}", flush=True)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    result = None
    tail = collections.deque(maxlen=80)
    for line in proc.stdout:  # the step lines; vLLM's own logging is kept for a failure report only
        tail.append(line)
        if line.startswith("held-out accuracy:"):
            result = line.strip()
        elif line.startswith("step "):
            print(line, end="", flush=True)
    if proc.wait() != 0 or result is None:
        print("".join(tail), file=sys.stderr)
        sys.exit(f"training failed (exit code {proc.returncode})")
    print(
        f"run folder: runs/tiny_cpu (metrics.jsonl, curve.png, final/) | total {time.time() - t0:.0f}s"
    )
    print(result)


if __name__ == "__main__":
    main()

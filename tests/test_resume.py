"""Long runs that survive: multi-node torchrun (two "nodes" on loopback).

    .venv/bin/python -m pytest -q tests/test_resume.py
"""
import json
import math
import os
import socket
import subprocess
import sys

from conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(model, data_dir, out, *extra):
    return ["train.py", "--config", "configs/tiny_cpu.yaml", "--model", model, "--train-data", f"{data_dir}/train.jsonl",
            "--val-data", f"{data_dir}/val.jsonl", "--out-dir", str(out), "--max-steps", "2", "--group-size", "4",
            "--prompts-per-step", "4", "--eval-max-samples", "4", "--eval-every", "0", "--no-save", *extra]


def test_two_nodes_on_loopback(tmp_path, tiny_model, synth):
    """Two torchrun agents, --nnodes=2 with one process each, meet through c10d rendezvous on 127.0.0.1:
    the command line a real 2-node job uses, with the node's address in place of 127.0.0.1."""
    port, out = free_port(), tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={n}",
                               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                               "--rdzv-id=nvr1-test", "--max-restarts=0",
                               *train_cmd(tiny_model, synth, out, "--cache-dir", str(tmp_path / "frames"))],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-4000:] for x in logs)
    assert "world 2" in logs[0]  # one process per node, one world
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)

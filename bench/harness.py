"""What the benchmarks share: the repository (ROOT) and its scripts/ first on sys.path, as each entry script puts
them; a command run in the repository that must succeed; train.py's tiny run under torchrun."""

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from repo import torchrun  # noqa: E402  (scripts/ is on sys.path from the line above)


def launch(cmd: list[str], what: str, **env: str) -> str:
    """`cmd` in the repository, `env` over os.environ: its stdout; a failure exits naming `what`, with the tails of
    its stdout and stderr."""
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{what} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p.stdout


def train(ranks: int, out: str, steps: int, flags: list[str], what: str, **env: str) -> list[dict]:
    """train.py on configs/tiny_cpu.yaml under torchrun, `flags` over it, `steps` steps into a fresh `out` (no
    held-out set, nothing saved): metrics.jsonl's rows."""
    shutil.rmtree(out, ignore_errors=True)
    args = [
        "train.py",
        "--config",
        "configs/tiny_cpu.yaml",
        "--val-data",
        "",
        "--no-save",
        "--out-dir",
        out,
    ]
    launch(torchrun(ranks, *args, "--max-steps", str(steps), *flags), what, **env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]

"""What the bench scripts share: the project root, a fresh measured process, one table printer."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = [ROOT, os.path.join(ROOT, "scripts")]  # a bench script puts these first on sys.path: the project's modules
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run(cmd: list[str], what: str, **env: str) -> str:
    """cmd in a fresh process in the project root, one thread per process; its stdout, or exit with its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) | env
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{what} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p.stdout


def table(header: list[str], rows: list[list]) -> None:
    """A markdown table after a blank line, each column as wide as its widest cell."""
    cells = [header, *[[str(cell) for cell in row] for row in rows]]
    widths = [max(map(len, column)) for column in zip(*cells)]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in cells]
    print("\n".join(["", lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]]), flush=True)

"""The repository: its root (ROOT), put first on sys.path with scripts/ so that a script run as
`python scripts/X.py` imports the project's modules and the other scripts (gpu_check.py and memory_plan.py, which
their tests run by path alone, and the two make_* scripts keep their own lines); torchrun(), a launch's command line."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


def torchrun(ranks: int, *args: str) -> list[str]:
    """The command line of `torchrun --standalone --nproc_per_node=ranks args`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        *args,
    ]

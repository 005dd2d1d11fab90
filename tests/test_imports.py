"""The library's import graph: no circle, nothing from scripts/ or bench/, and `import train` beside other projects'
top-level `scripts` packages (verl ships one)."""

import ast
import glob
import os
import subprocess
import sys

from conftest import ROOT

LIBRARY = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))


def imported(module: str) -> set[str]:
    """The top-level names a module imports anywhere in its source (a function's lazy import too)."""
    with open(os.path.join(ROOT, module + ".py")) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_library_imports_form_no_circle_and_never_reach_scripts_or_bench():
    graph = {m: imported(m) & set(LIBRARY) - {m} for m in LIBRARY}
    assert {"train", "cache", "common"} <= set(graph)
    for m in LIBRARY:
        assert not imported(m) & {"scripts", "bench"}, f"{m}.py imports from scripts/ or bench/"
    floors = []  # modules in an order where each imports only modules before it; a circle never gets a place
    while len(floors) < len(graph):
        ready = [m for m in graph if m not in floors and graph[m] <= set(floors)]
        assert ready, f"import circle among {sorted(set(graph) - set(floors))}"
        floors += ready
    assert (
        floors.index("common")
        < floors.index("ckpt")
        < floors.index("rollout")
        < floors.index("train")
    )


def test_train_imports_beside_a_foreign_scripts_package(tmp_path):
    """A regular `scripts` package first on sys.path wins over our namespace folder: train must not need ours."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "__init__.py").write_text("FOREIGN = True\n")
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {ROOT!r}]; import scripts, train; print(scripts.FOREIGN)"
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr[-3000:]

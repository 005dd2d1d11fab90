"""notebooks/quickstart.ipynb, executed top to bottom in a real Jupyter kernel (nbclient), so it never rots.

.venv/bin/python -m pytest -q tests/test_notebook.py
"""

import json
import os

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # a kernel, a tiny training run and a generation: about a minute


def test_quickstart_notebook_runs(tiny_model, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    import data
    import rewards

    nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits the environment
    NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": f"{ROOT}/notebooks"}},
    ).execute()  # a failing cell raises
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the curve was drawn
    run = os.path.join(ROOT, "runs", "notebook")
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, 7)) and "eval/accuracy" in rows[2]
    assert [json.loads(line)["step"] for line in open(os.path.join(run, "samples.jsonl"))] == [
        3,
        3,
        6,
        6,
    ]
    # the last cell scored one held-out video with the trained model: its printed reward is the reward function's
    printed = "".join(o["text"] for o in nb.cells[-1].outputs if o.get("name") == "stdout")
    scored = json.loads(printed.strip().splitlines()[-1])
    sample = data.load_samples(os.path.join(ROOT, ".cache/data/notebook_color/val.jsonl"))[0]
    assert scored["id"] == sample["id"] and scored["answer"] == sample["answer"]
    overall, components = rewards.compute_reward(scored["completion"], sample)
    assert scored["reward"] == overall and scored["accuracy"] == components["accuracy"]

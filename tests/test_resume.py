"""Long runs that survive: multi-node torchrun (two "nodes" on loopback), exact resume after a SIGKILL, SIGTERM
checkpoints, export.

    .venv/bin/python -m pytest -q tests/test_resume.py
"""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import (
    ROOT,
    background,
    color_data_dir,
    lane_result,
    tiny_model_dir,
    train_cmd,
    val_with_missing_file,
)

pytestmark = pytest.mark.slow  # torchrun jobs, killed and resumed


# ---------------------------------------------------------------------------------------------------
# Checkpoints, exact resume, preemption, export. Three runs are shared by the tests (each run is a torchrun job with
# two vLLM engines, the most expensive thing here): the 4-step 2-node run (conftest's `uninterrupted`, shared with
# test_train), the killed-and-resumed run, both on color_data with a 3-sample held-out set, and the SIGTERM run
# (--val-data '', no eval), which starts from the 4-step run's export and so also shows that vLLM loads it.


def torchrun(model, data_dir, out, *extra, steps=4):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        *train_cmd(
            model,
            data_dir,
            out,
            "--val-data",
            "",
            "--max-steps",
            str(steps),
            "--cache-dir",
            str(out.parent / "frames"),
            *extra,
        ),
    ]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def last_rows(out) -> dict:
    """step -> the last row written for it (a resumed run writes the steps after its checkpoint again)."""
    return {r["step"]: r for r in map(json.loads, open(out / "metrics.jsonl"))}


def worker(p, rank: int):
    """torchrun's worker process of this rank (a direct child, RANK in its environment)."""
    import psutil

    return next(c for c in psutil.Process(p.pid).children() if c.environ().get("RANK") == str(rank))


def wait_for(path, p, timeout=300):
    import time

    t = time.time()
    while not os.path.exists(path):
        assert p.poll() is None and time.time() - t < timeout, (
            f"{path} never appeared: " + p.stdout.read()[-4000:]
        )
        time.sleep(0.2)


def test_two_nodes_on_loopback(uninterrupted):
    out, logs = uninterrupted
    assert "world 2" in logs[0]  # one process per node, one world
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in rows)


@background("killed_and_resumed")
def killed_and_resumed_run(tmp_path_factory):
    """The uninterrupted run's settings on `--standalone` torchrun: rank 1 is SIGKILLed once step 2's checkpoint is
    complete, then `--resume auto` runs steps 3 and 4 (in conftest's background lane). Returns (run folder,
    skipped.jsonl's rows after the kill)."""
    out, tiny_model, color_data = (
        tmp_path_factory.mktemp("killed") / "run",
        tiny_model_dir(),
        color_data_dir(),
    )
    args = (
        "--val-data",
        val_with_missing_file(tmp_path_factory),
        "--skip-invalid",
        "--save-every",
        "2",
    )

    def run():
        p = torchrun(tiny_model, color_data, out, *args)
        wait_for(out / "ckpt" / "latest", p)  # step 2 is complete ...
        worker(p, 1).kill()  # ... and rank 1 dies mid-run (SIGKILL: no handler, no checkpoint)
        log = p.communicate(timeout=300)[0]
        assert p.returncode != 0, log[-3000:]
        assert open(out / "ckpt" / "latest").read() == "step_00000002"
        skipped = [json.loads(line) for line in open(out / "skipped.jsonl")]
        p = torchrun(tiny_model, color_data, out, *args, "--resume", "auto")
        log = p.communicate(timeout=600)[0]
        assert p.returncode == 0 and "resumed from" in log, log[-4000:]
        return out, skipped

    return run


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    return lane_result("killed_and_resumed", tmp_path_factory)


def test_sigkill_one_rank_then_resume_matches(killed_and_resumed, uninterrupted):
    full, resumed = last_rows(uninterrupted[0]), last_rows(killed_and_resumed[0])
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (
        3,
        4,
    ):  # same data, same samples, same update: equal up to fp noise (bit-equal in practice)
        a, b = full[step], resumed[step]
        assert a["data/ids"] == b["data/ids"]
        for k in ("reward/mean", "loss", "grad_norm", "entropy", "len/mean", "mismatch/mean", "lr"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (step, k)
    # keep_last 1: only the newest checkpoint, no half-written folders
    assert sorted(os.listdir(uninterrupted[0] / "ckpt")) == ["latest", "step_00000004"]


def test_resume_keeps_skip_report_exact(killed_and_resumed):
    """A held-out sample whose video is missing is skipped once; a resumed run restores that report from the
    checkpoint instead of adding it a second time."""
    out, skipped_before_resume = killed_and_resumed
    for skipped in (
        skipped_before_resume,
        [json.loads(line) for line in open(out / "skipped.jsonl")],
    ):
        assert [s["where"] for s in skipped] == ["val-missing-video"]
    assert last_rows(out)[4]["data/skipped"] == 1


@pytest.fixture(scope="module")
def exported(tmp_path_factory, uninterrupted) -> str:
    """The uninterrupted run's last checkpoint as an HF folder (scripts/export_hf.py)."""
    import export_hf

    return export_hf.export(
        str(uninterrupted[0] / "ckpt" / "latest"), str(tmp_path_factory.mktemp("export") / "hf")
    )


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory, exported, synth):
    """50 steps on synth from the exported folder (vLLM builds each rank's engine from it: the export's vLLM check,
    one fresh vLLM process fewer), SIGTERM to rank 1 once step 1 is logged. Returns (run folder, log, returncode)."""
    out = tmp_path_factory.mktemp("sigterm") / "run"
    p = torchrun(exported, synth, out, steps=50)
    wait_for(out / "metrics.jsonl", p)
    worker(p, 1).terminate()  # only rank 1 is told: the ranks agree at the step boundary
    return out, p.communicate(timeout=300)[0], p.returncode


def test_sigterm_checkpoints_and_exits_zero(sigterm_run):
    out, log, returncode = sigterm_run
    assert returncode == 0, log[-4000:]
    rows = last_rows(out)
    stopped = max(rows)
    assert stopped < 50 and "stop signal" in log
    assert open(out / "ckpt" / "latest").read() == f"step_{stopped:08d}"
    meta = json.load(open(out / "ckpt" / f"step_{stopped:08d}" / "meta.json"))
    assert (
        meta["step"] == stopped
        and meta["data"]["epoch"] * 40 + meta["data"]["cursor"] == 4 * stopped
    )  # 40 samples


def test_export_loads_in_transformers_and_vllm(exported, tiny_model, uninterrupted, sigterm_run):
    import torch
    from transformers import AutoModelForImageTextToText

    def load(d):
        return AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).state_dict()

    exported_sd, final = (
        load(exported),
        load(str(uninterrupted[0] / "final")),
    )  # final: saved by the run at step 4
    assert exported_sd.keys() == final.keys() and all(
        torch.equal(exported_sd[k], final[k]) for k in final
    )
    assert any(
        not torch.equal(exported_sd[k], v) for k, v in load(tiny_model).items()
    )  # the trained weights
    # vLLM: the SIGTERM run built its engines from the folder as written and sampled step 1 with them
    out, log, _ = sigterm_run
    meta = json.load(open(out / "ckpt" / open(out / "ckpt" / "latest").read() / "meta.json"))
    assert meta["config"]["model"] == exported and "rollout vllm tp=1" in log, log[-4000:]
    assert last_rows(out)[1]["len/mean"] > 0

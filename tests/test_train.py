"""train.py end to end: real FSDP2 under `torchrun --nproc_per_node=2` (gloo), real colocated vLLM.

.venv/bin/python -m pytest -q tests/test_train.py
"""

import json
import math
import os

import pytest
import torch
from conftest import (
    LIBRARY_NOISE,
    Runs,
    Share,
    color_data_dir,
    quiet_lines,
    share_of,
    tiny_model_dir,
    two_rank_share,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # torchrun jobs with colocated vLLM engines


def train_args(tmp_path, model, data_dir, *extra) -> list[str]:
    """train.py's arguments: 2 steps of 4 prompts x 4 into tmp_path/run, the frame cache in tmp_path/frames."""
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        "--model",
        model,
        "--train-data",
        f"{data_dir}/train.jsonl",
        "--val-data",
        f"{data_dir}/val.jsonl",
        "--out-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "2",
        "--group-size",
        "4",
        "--prompts-per-step",
        "4",
        "--cache-dir",
        str(tmp_path / "frames"),
        "--eval-every",
        "0",
        *extra,
    ]


def weights(folder):
    files = [
        os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")
    ]
    return {k: v for file in files for k, v in load_file(file).items()}


def test_two_rank_fsdp_vllm_steps_tp2(runs, tiny_model, color_data):
    """2 steps, --standalone torchrun, both ranks share one tensor-parallel vLLM engine (rollout_tp 2)."""
    tp2 = runs["tp2"]
    check_vllm_run(tp2.folder, tp2.rows, tp2.log, tiny_model, color_data, 2)
    # each prompt prepared by one rank of the engine (the other gets its frames): no cache hit from a second read
    assert [r.get("cache/cache_hit", 0) for r in tp2.rows] == [0, 0], tp2.rows
    for step in (0, 2):  # held-out rows scored once each
        ids = [json.loads(x)["doc_id"] for x in open(tp2.folder / "eval" / f"step_{step}.jsonl")]
        assert len(ids) == len(set(ids)) == 4


def test_two_rank_fsdp_vllm_steps_tp1(uninterrupted, tiny_model, color_data):
    """One vLLM engine per rank (rollout_tp 1): the checks run on conftest's 4-step 2-node run (shared with
    test_resume, one 2-rank vLLM launch fewer); node 0's log holds rank 0's output, node 1's must be clean too."""
    out, logs = uninterrupted
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    check_vllm_run(out, rows, logs[0], tiny_model, color_data, 4)
    assert "torch.set_num_threads" not in logs[1] and "Traceback" not in logs[1]
    # node 1's held-out share is the sample with a missing video alone: it generates a pad, which is not scored
    for step in (0, 4):
        ids = [json.loads(line)["doc_id"] for line in open(out / "eval" / f"step_{step}.jsonl")]
        assert len(ids) == len(set(ids)) == 2 and "val-missing-video" not in ids


def test_a_run_prints_a_line_per_step(uninterrupted):
    """issue 29: conftest's 4-step 2-node run (2 checkpoint saves) prints the step-0 line, a line per step and per
    save and the final line; no library warning or progress bar (common.quiet: test_cli checks that
    other warnings and errors still print). Was 51 lines for a 4-step 2-rank run, 43 of them torch's and vLLM's."""
    lines = quiet_lines(
        *uninterrupted[1]
    )  # node 1: torchrun's note that --node-rank is ignored with c10d
    assert len(lines) <= 4 + 6 and not [x for x in lines if LIBRARY_NOISE.search(x)], "\n".join(
        uninterrupted[1]
    )


def check_vllm_run(out, rows, stdout, tiny_model, color_data, steps):
    """A finished vLLM run of `steps` steps of 4 prompts x 4 on color_data, its frame cache cold at the start."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert (
        "eval/accuracy" not in rows[0] and 0.0 <= rows[-1]["eval/accuracy"] <= 1.0
    )  # the final eval is logged
    assert rows[0]["offline/share"] == pytest.approx(
        0.25
    )  # 1 of each group of 4 is the offline trajectory
    # vLLM and the trainer hold the same weights at step 1: float noise (4.8e-7; 2.9e-3 with transformers' positions)
    assert rows[0]["mismatch/max"] < 1e-4
    # a cold cache decodes each distinct video once, even when tp ranks load the same prompts (per-key lock)
    assert [r["cache/decode"] for r in rows] == [
        4
    ] * steps  # 16 samples: steps <= 4 load each one at most once
    assert "held-out accuracy: before" in stdout
    # quiet: vLLM's CPU worker warned on every torch.set_num_threads (twice per request); one line per step with ETA
    assert "torch.set_num_threads" not in stdout and "Traceback" not in stdout
    assert any(
        x.startswith(f"step {steps}/{steps} |") and x.endswith("| ETA 0:00:00")
        for x in stdout.splitlines()
    )
    # samples.jsonl: every step (log_every 1), the first completion of each group, scored as by the reward function
    import data
    import rewards

    samples = {s["id"]: s for s in data.load_samples(f"{color_data}/train.jsonl")}
    shown = [json.loads(line) for line in open(out / "samples.jsonl")]
    # prompts_per_step 4: min(log_samples 4, groups)
    assert [r["step"] for r in shown] == [step for step in range(1, steps + 1) for _ in range(4)]
    for r, row in zip(shown, [row for row in rows for _ in range(4)]):
        assert (
            r["id"] in row["data/ids"]
            and r["finish"] in ("stop", "length")
            and math.isfinite(r["advantage"])
        )
        overall, components = rewards.compute_reward(r["response"], samples[r["id"]])
        assert r["reward"] == dict(components, overall=overall)
    before, after = weights(tiny_model), weights(out / "final")
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, "training did not change the weights"


@two_rank_share
def three_runs(tmp_path_factory) -> Share:
    """Three runs in conftest's shared 2-rank launch (tests/train_worker.py: torchrun's start and the imports are paid
    once). "hf": the HF engine, 2 ranks, the frame cache built first by cache_frames.py, 3 held-out prompts (uneven
    on 2 ranks), a checkpoint at step 2; "again": `--resume auto` on that finished run; "tp2": both ranks share one
    tensor-parallel vLLM engine (rollout_tp 2), its frame cache cold."""
    import cache_frames

    tiny_model, color_data = tiny_model_dir(), color_data_dir()
    hf, tp2 = tmp_path_factory.mktemp("hf"), tmp_path_factory.mktemp("tp2")
    cache_frames.preprocess(
        cache_frames.Config(
            data=[f"{color_data}/train.jsonl", f"{color_data}/val.jsonl"],
            out=str(hf / "frames"),
            video_fps=4.0,
            video_min_frames=4,
            video_max_frames=8,
            video_min_pixels=3136,
            video_max_pixels=3136,
            factor=28,
        )
    )
    args = train_args(
        hf,
        tiny_model,
        color_data,
        "--rollout",
        "hf",
        "--eval-max-samples",
        "3",
        "--no-save",
        "--save-every",
        "2",
    )  # uneven eval hanging in a collective: conftest's --dist-timeout 120
    return Share(
        {
            "hf": args,
            "again": [*args, "--resume", "auto"],
            "tp2": train_args(tp2, tiny_model, color_data, "--rollout-tp", "2"),
        }
    )


@pytest.fixture(scope="module")
def runs(two_rank) -> Runs:
    """three_runs' name -> Run (conftest's shared launch, in the background lane)."""
    return share_of(two_rank, __name__)


def test_hf_rollout_two_ranks_warm_cache(runs):
    """HF engine, with the frame cache built first by scripts/cache_frames.py: no decode in any step."""
    rows = runs["hf"].rows
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(
        r["cache/decode"] == 0 and r["cache/cache_hit"] == 4 for r in rows
    )  # each prompt loaded once a step
    assert rows[0]["mismatch/mean"] < 1e-4  # same model samples and scores


def test_hf_rollout_two_ranks_uneven_eval(runs):
    """3 held-out prompts on 2 ranks: the HF engine's generate is collective (FSDP), so both ranks must call it
    equally often; each prompt is still scored once. `--resume auto` on the finished run trains nothing and reports
    the saved held-out accuracies (it once printed "after nan")."""
    out, rows, stdout = runs["hf"].folder, runs["hf"].rows, runs["hf"].log
    rows_again, again = runs["again"].rows, runs["again"].log
    assert len(rows) == 2 and "held-out accuracy: before" in stdout
    for step in (0, 2):
        ids = [json.loads(line)["doc_id"] for line in open(out / "eval" / f"step_{step}.jsonl")]
        assert len(ids) == len(set(ids)) == 3
    result = [x for x in stdout.splitlines() if x.startswith("held-out accuracy:")]
    assert len(rows_again) == 2 and "max_steps 2 reached, nothing to train" in again
    assert [x for x in again.splitlines() if x.startswith("held-out accuracy:")] == result
    assert "nan" not in result[0] and result[0].endswith(f"after {rows[-1]['eval/accuracy']:.2f}")


def test_trim_rows_keeps_steps_up_to_the_checkpoint(tmp_path, capsys):
    """A run into an out_dir that holds an earlier run's logs: a fresh run (step 0) keeps none of its rows; a resumed
    one keeps the rows up to its checkpoint's step and drops the later ones and a line torn by a crash."""
    import train

    path = tmp_path / "metrics.jsonl"
    lines = (
        "".join(json.dumps({"step": s, "loss": 0.1 * s}) + "\n" for s in (1, 2, 3, 4))
        + '{"step": 5, "lo'
    )
    path.write_text(lines)
    train.trim_rows(str(path), 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert "3 rows past step 2" in capsys.readouterr().out
    train.trim_rows(str(path), 0)
    assert path.read_text() == ""
    train.trim_rows(str(tmp_path / "absent.jsonl"), 0)  # nothing to trim: no file is created
    assert not (tmp_path / "absent.jsonl").exists()


def test_fsdp_choice_and_its_refusals(tiny_model):
    """issue 46: auto replicates on several CPU ranks, keeps FSDP2's bf16 blocks gathered on GPUs where whole fp32
    weights, gradients, AdamW moments and summed gradients fit a quarter of one, else reshards (one rank, offload,
    too large); offload with keep or replicate is refused before anything loads."""
    import train
    from common import UserError
    from conftest import tiny_config

    cfg = tiny_config(model=tiny_model, fsdp="auto")
    gpu = 4 * 20 * 1000  # bytes: 1,000 parameters fit (20 bytes each in a quarter)
    assert train.fsdp_choice(cfg, 1000, math.inf, False, 2) == "replicate"  # CPU ranks
    assert train.fsdp_choice(cfg, 1000, gpu, True, 2) == "keep"
    assert train.fsdp_choice(cfg, 1001, gpu, True, 2) == "reshard"
    assert train.fsdp_choice(cfg, 1000, gpu, True, 1) == "reshard"
    offload = tiny_config(model=tiny_model, fsdp="auto", offload=True)
    assert train.fsdp_choice(offload, 1000, gpu, True, 2) == "reshard"
    assert train.fsdp_choice(tiny_config(fsdp="keep"), 1000, 0, False, 2) == "keep"
    for fsdp in ("keep", "replicate"):
        with pytest.raises(UserError, match=f"offload .* needs fsdp reshard, not {fsdp}"):
            bad = tiny_config(model=tiny_model, fsdp=fsdp, offload=True, world=2, rollout="hf")
            train.check_config(bad, 2)  # rollout hf: no vLLM config check (seconds)

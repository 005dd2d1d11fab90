"""loss_type sft, the cold start before RL (issue 41): the loss on a micro-batch is the masked NLL of the reference
responses computed by hand from the model's own forward (the prompt and the padding contribute nothing), on a joint
image + video micro-batch, gradients included; train.py's SFT runs through the CLI, one process
(test_faults.TRAIN_DRIVER, in the background lane): exact resume, LoRA, stage two (GRPO from the SFT run's final/,
its reference the SFT model: KL 0 at the first step); and sp_size 2 in conftest's shared 2-rank launch against the
one-process run (loss and gradient norm).

    .venv/bin/python -m pytest tests/test_sft.py -x -q
"""

import math
from dataclasses import replace

import pytest
import torch
from conftest import (
    Share,
    background,
    lane_result,
    share_of,
    synth_dir,
    tiny_config,
    tiny_model_dir,
    two_rank_share,
)

import data
import sp
import train
from rollout import vision_token_ids


@pytest.fixture(scope="module")
def setup(tiny_model, synth):
    """The tiny model (fp32), and a micro-batch of 2 video and 1 image prompts with their offline_output (lengths
    differ: right padding), as OfflineEngine makes them."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32)
    samples = data.load_samples(f"{synth}/train.jsonl")
    picked = [s for s in samples if s.get("videos")][:2] + [s for s in samples if s.get("images")][
        :1
    ]
    picked[1] = dict(
        picked[1], offline_output="<think>a longer reference</think><answer>B</answer>"
    )
    prompts = [data.prepare(s, proc, tiny_config()) for s in picked]
    eos = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollouts = train.OfflineEngine(proc.tokenizer, eos).generate(prompts, 1, 1.0, 64, seed=0)
    return proc, model, rollouts


def hand_nll(model, rollouts, banned) -> list[torch.Tensor]:
    """Each row alone (no padding), the model's own forward over prompt + response: -log p of each response token at
    temperature 1, vision tokens masked as the sampler masks them."""
    out = []
    for r in rollouts:
        ids = torch.tensor([r.prompt.prompt_ids + r.response_ids])
        attn = torch.ones_like(ids)
        pos = sp.mrope_positions(ids, attn, data.grids([r.prompt], "cpu"), model.config)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, **r.prompt.mm).logits[
            0
        ]
        logits = logits.float()
        logits[:, banned] = float("-inf")
        P = len(r.prompt.prompt_ids)
        logp = torch.log_softmax(logits[P - 1 : -1], -1)  # the positions predicting the response
        out.append(-logp.gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0])
    return out


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_sft_loss_is_masked_nll(setup, agg):
    proc, model, rollouts = setup
    banned = vision_token_ids(proc.tokenizer)
    assert len({len(r.response_ids) for r in rollouts}) > 1  # the micro-batch pads its responses
    assert [r.finish for r in rollouts] == ["offline"] * 3
    b = train.collate(rollouts, proc.tokenizer.pad_token_id, "cpu")
    # the sampler's temperature must not reach the NLL
    cfg = tiny_config(loss_type="sft", group_size=1, loss_agg=agg, temperature=0.7)
    n_tok, n_seq = b.mask.sum().item(), 3.0
    b.n_tok, b.n_seq = n_tok, n_seq
    model.zero_grad()
    loss, metrics = train.micro_loss(model, b, cfg, banned)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    nll = hand_nll(model, rollouts, banned)
    want = sum(x.sum() for x in nll) / n_tok
    if agg == "seq-mean-token-mean":
        want = sum(x.mean() for x in nll) / n_seq
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-5 * want.item(), (loss.item(), want.item())
    assert metrics["clipfrac"] == 0 and metrics["mismatch_n"] == 0  # no sampler, nothing clipped
    # the same gradient everywhere, the vision tower included (the image and the videos)
    assert grads.keys() == {k for k, p in model.named_parameters() if p.grad is not None}
    for k, p in model.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-5, rtol=1e-3), k
    assert any("visual" in k and grads[k].abs().sum() > 0 for k in grads)


def test_a_cut_reference_is_counted(setup):
    """A reference longer than max_response_len is cut, like any completion, and marked "length" (len/truncated),
    whatever mix_offline says (SFT never swaps)."""
    proc, _, rollouts = setup
    eos = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    p = rollouts[1].prompt
    (cut,) = train.OfflineEngine(proc.tokenizer, eos).generate([p], 1, 1.0, 3, seed=0)
    assert (len(cut.response_ids), cut.finish) == (3, "length")
    group = train.Group([cut], [{"accuracy": 0.0}])
    cfg = tiny_config(loss_type="sft", group_size=1, mix_offline=True)
    assert train.swap_offline(group, cfg, proc.tokenizer, eos) is group


def sft_args(out, *extra) -> list[str]:
    """train.py's arguments for a tiny SFT run on synth_dir (images and videos), HF eval engine."""
    data_dir = synth_dir()
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        "configs/sft.yaml",
        "--model",
        tiny_model_dir(),
        "--train-data",
        f"{data_dir}/train.jsonl",
        "--val-data",
        "",
        "--out-dir",
        str(out),
        "--prompts-per-step",
        "4",
        "--max-tokens-per-micro-batch",
        "2100",
        "--eval-every",
        "0",
        "--cache-dir",
        "",
        "--video-source",
        "decode_only",
        *extra,
    ]


@background("sft_runs")
def sft_runs(tmp_path_factory):
    """One process (test_faults.TRAIN_DRIVER): "sft" 3 steps, a checkpoint at step 2 and final/; "resumed" step 3
    again from that checkpoint in a fresh out_dir; "lora" 2 steps of SFT with adapters; "rl" 1 GRPO step from
    sft/final (HF sampler, kl_coef 0.01, held-out eval on 4 samples). Returns (folder, key -> finished run)."""
    from test_faults import drive

    import sys

    out = tmp_path_factory.mktemp("sft")
    runs = {
        "sft": sft_args(out / "sft", "--max-steps", "3", "--save-every", "2", "--save"),
        "resumed": sft_args(
            out / "resumed",
            "--max-steps",
            "3",
            "--resume",
            str(out / "sft/ckpt/step_00000002"),
            "--no-save",
        ),
        "lora": sft_args(out / "lora", "--max-steps", "2", "--lora-rank", "4", "--no-save"),
        "rl": [
            "--config",
            "configs/tiny_cpu.yaml",
            "--model",
            str(out / "sft/final"),
            "--train-data",
            f"{synth_dir()}/train.jsonl",
            "--val-data",
            f"{synth_dir()}/val.jsonl",
            "--eval-max-samples",
            "4",
            "--out-dir",
            str(out / "rl"),
            "--rollout",
            "hf",
            "--kl-coef",
            "0.01",
            "--group-size",
            "4",
            "--prompts-per-step",
            "2",
            "--max-steps",
            "1",
            "--no-save",
            "--cache-dir",
            "",
        ],
    }

    def run():
        return out, drive(runs, [sys.executable])

    return run


def rows(folder) -> list[dict]:
    import json

    return [json.loads(line) for line in open(folder / "metrics.jsonl")]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    return lane_result("sft_runs", tmp_path_factory)


@pytest.mark.slow  # train.py runs
def test_sft_cli_resume_lora(cli):
    out, done = cli
    for key in ("sft", "resumed", "lora"):
        assert done[key].returncode == 0, done[key].stdout[-3000:]
    full, resumed = rows(out / "sft"), rows(out / "resumed")
    assert [r["step"] for r in full] == [1, 2, 3] and [r["step"] for r in resumed] == [3]
    assert full[2]["loss"] < full[0]["loss"]  # it learns the references
    assert full[0]["reward/accuracy"] == 1.0 and full[0]["len/truncated"] == 0  # the data's answers
    for k in ("loss", "grad_norm", "data/ids"):  # the same samples, weights and AdamW state
        assert resumed[0][k] == full[2][k] or math.isclose(resumed[0][k], full[2][k], rel_tol=1e-6)
    assert (out / "sft/final/config.json").exists()
    # LoRA: the adapters start at B = 0, so the first step's loss is the full run's; then they train
    lora = rows(out / "lora")
    assert math.isclose(lora[0]["loss"], full[0]["loss"], rel_tol=1e-5)
    assert lora[0]["grad_norm"] > 0 and lora[1]["loss"] != full[1]["loss"]


@pytest.mark.slow  # train.py runs
def test_rl_from_sft(cli):
    """Stage two: GRPO from the SFT run's final/ (its weights; its reference: KL 0 before the first update)."""
    out, done = cli
    assert done["rl"].returncode == 0, done["rl"].stdout[-3000:]
    (row,) = rows(out / "rl")
    assert row["kl"] == 0.0 and row["loss"] == row["loss"]
    assert "held-out accuracy: before" in done["rl"].stdout


@two_rank_share
def sp_share(tmp_path_factory) -> Share:
    """conftest's shared 2-rank launch: "sft_sp2", test_sft_cli's "sft" config on sp_size 2 (one data-parallel
    rank: the same rows), 1 step."""
    out = tmp_path_factory.mktemp("sft_sp")
    return Share({"sft_sp2": sft_args(out, "--sp-size", "2", "--max-steps", "3", "--no-save")})


@pytest.mark.slow  # train.py runs
def test_sft_sp2_matches_one_process(cli, two_rank):
    """SP exactness: the loss and gradient norm of each step on 2 SP ranks are the one process's."""
    out, _ = cli
    sp2 = share_of(two_rank, __name__)["sft_sp2"].rows
    one = rows(out / "sft")
    assert [r["step"] for r in sp2] == [1, 2, 3]
    for a, b in zip(sp2, one):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-3)
        assert sorted(a["data/ids"]) == sorted(b["data/ids"])  # the SP group's rows in its order


def test_sft_config_and_data_errors(tmp_path, synth):
    """What SFT cannot do fails before a model loads: settings that need rollouts, a training sample without the
    reference response (named: file, line, sample, field; --skip-invalid: skipped and reported)."""
    import json

    with pytest.raises(ValueError, match="loss_type sft needs group_size 1, kl_coef 0"):
        train.check_config(train.Config(loss_type="sft", group_size=4, rollout="hf"))
    rows = [json.loads(line) for line in open(f"{synth}/train.jsonl")][:3]
    del rows[1]["offline_output"]
    path = tmp_path / "sft.jsonl"
    text_only = [
        {k: v for k, v in r.items() if k not in ("videos", "images", "data_type")} for r in rows
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in text_only))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    cfg = tiny_config(loss_type="sft", train_data=str(path), val_data="")
    with pytest.raises(
        data.DataError, match=rf"sft.jsonl:2: sample {rows[1]['id']}: offline_output"
    ):
        train.load_data(cfg, tok, None, [])
    skipped = []
    kept = train.load_data(replace(cfg, skip_invalid=True), tok, None, skipped)["train"]
    assert [s["id"] for s in kept] == [rows[0]["id"], rows[2]["id"]]
    assert [s["where"] for s in skipped] == [f"{path}:2"]


def test_memory_plan_knows_sft():
    """The 7B SFT recipe (configs/qwen2_5_vl_7b_sft.yaml, its comment's numbers) fits 8 x 80 GiB; SFT's only vLLM
    engine is the held-out evaluation's (none without val_data), and no engine is handed the training pixels."""
    import memory_plan

    gib = 2**30
    cfg = train.load_config(
        ["--config", "configs/qwen2_5_vl_7b.yaml", "configs/qwen2_5_vl_7b_sft.yaml"]
    )
    spec, meas = memory_plan.stored(cfg.model, "bfloat16")
    prompt, patches = memory_plan.longest_prompt(cfg, 720, 1280)
    args = (spec, meas, 8, 80 * gib, True, prompt, patches)
    sft = memory_plan.plan(cfg, *args)
    assert sft.verdict == "FITS"
    assert (round(sft.train / gib, 1), round(sft.generation / gib, 1)) == (56.7, 51.6)
    no_val = memory_plan.plan(replace(cfg, val_data=""), *args)
    assert no_val.vllm_need == 0 and no_val.generation == sft.generation - 0.5 * 80 * gib
    rl = memory_plan.plan(replace(cfg, loss_type="ppo"), *args)
    pixels = [k for k in sft.host if k.startswith("pixels")]
    assert sum(sft.host[k] for k in pixels) < sum(
        rl.host[k] for k in rl.host if k.startswith("pixels")
    )

"""vllm_embeds (issue 40 item c): vLLM generates from the trainer's frozen-tower features instead of pixels, on the
real vLLM engine and the tiny checkpoints of the three families (no mocks).

    .venv/bin/python -m pytest -q tests/test_embeds.py

Checks: an engine fed features samples the same tokens with the same log-probs as one fed pixels (greedy and sampled,
video and image prompts) and as the trainer computes them; it loads no vision tower (Qwen3-VL: loaded, never run:
vLLM drops deepstack without it); its weight sync skips the tower and still moves the language model; a 2-step train
run with --vllm-embeds encodes each prompt's media once per step.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path[:0] = [
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(os.path.abspath(__file__)),
]
from conftest import (  # noqa: E402
    ROOT,
    color_data_dir,
    free_port,
    synth_dir,
    tiny_config,
    tiny_model_dir,
    train_cmd,
    trainer_logp_diff,
)

import data  # noqa: E402
import sp  # noqa: E402
from rollout import VLLMEngine  # noqa: E402
from train import Config, check_config  # noqa: E402

# test_rollout's: measured 9.5e-7 per token in fp32 on this CPU (pixels and features alike)
LOGP_TOL, STALE = 1e-4, 0.1


class Encoder:
    """train.frozen_features' work for a plain model: the features of the prompts, counted."""

    def __init__(self, model):
        self.model = model
        self.encodes = 0

    def __call__(self, prompts: list) -> list[dict]:
        out = []
        for p in prompts:
            with torch.no_grad():
                vision = sp.encode_vision(self.model, [p], "cpu")
            self.encodes += vision.encodes
            out.append({kind: f.local for kind, f in vision.kinds.items()})
        return out


def engine(model_dir, tokenizer, encoder=None) -> VLLMEngine:
    """A further engine in this process takes vLLM's external-launcher path (test_rollout's qwen2 fixture): a world
    of one, on a fresh port."""
    world = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in world.items():
            mp.setenv(k, v)
        mp.setenv("MASTER_PORT", str(free_port()))
        return VLLMEngine(
            model_dir, tokenizer, max_model_len=1024, dtype="float32", encoder=encoder
        )


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen2_vl"])
def family(request):
    """One family's processor, model, 2 video and 2 image prompts, a pixel engine and a features engine."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d = tiny_model_dir(request.param)
    proc = AutoProcessor.from_pretrained(d)
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    samples = data.load_samples(f"{synth_dir()}/train.jsonl")
    videos = [s for s in samples if s.get("videos")][:2]
    images = [s for s in samples if s.get("images")][:2]
    prompts = [data.prepare(s, proc, tiny_config(model=d).media()) for s in videos + images]
    encoder = Encoder(model)
    pixels = engine(d, proc.tokenizer)
    features = engine(d, proc.tokenizer, encoder)
    yield request.param, proc, model, prompts, pixels, features, encoder
    pixels.close()
    features.close()


@pytest.mark.slow
def test_features_sample_as_pixels(family):
    arch, proc, model, prompts, pixels, features, encoder = family
    before = encoder.encodes
    a = pixels.generate(prompts, n=4, temperature=1.0, max_tokens=12, seed=1)
    b = features.generate(prompts, n=4, temperature=1.0, max_tokens=12, seed=1)
    assert encoder.encodes - before == 4  # each prompt's one video or image, once
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    for kind in ("video", "image"):
        rows_a = [r for r in a if f"{kind}_grid_thw" in r.prompt.mm]
        rows_b = [r for r in b if f"{kind}_grid_thw" in r.prompt.mm]
        assert len(rows_b) == 8
        between = max(
            abs(x - y) for ra, rb in zip(rows_a, rows_b) for x, y in zip(ra.logp, rb.logp)
        )
        trainer = trainer_logp_diff(model, rows_b, proc.tokenizer)
        print(
            f"{arch} {kind}: |features - pixels| {between:.2e}, |features - trainer| {trainer:.2e}"
        )
        assert between < LOGP_TOL and trainer < LOGP_TOL, (kind, between, trainer)
    greedy_a = pixels.generate(prompts, n=1, temperature=0.0, max_tokens=10, seed=0)
    greedy_b = features.generate(prompts, n=1, temperature=0.0, max_tokens=10, seed=0)
    assert [r.response_ids for r in greedy_a] == [r.response_ids for r in greedy_b]


def vllm_tower(worker) -> tuple:
    """(tensors, elements) of the vision tower vLLM loaded."""
    named = [p for n, p in worker.model_runner.model.named_parameters() if "visual" in n]
    return len(named), sum(p.numel() for p in named)


@pytest.mark.slow
def test_no_tower_and_sync(family):
    """The features engine loads no tower (Qwen3-VL: it must keep one, vllm drops deepstack without it); its sync
    skips the tower and moves the language model as the trainer's weights move."""
    arch, proc, model, prompts, pixels, features, encoder = family
    kept = features.llm.collective_rpc(vllm_tower)[0]
    full = pixels.llm.collective_rpc(vllm_tower)[0]
    print(f"{arch}: vision tower tensors/elements in vLLM, features {kept}, pixels {full}")
    assert full[1] > 0
    assert kept == (full if arch == "qwen3_vl" else (0, 0))
    # noise on the language model only (the tower is frozen: the encoder's features stay the model's)
    new = type(model).from_pretrained(model.name_or_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if ".visual." not in f".{name}":
                p.add_(0.01 * torch.randn_like(p))
    stale = trainer_logp_diff(new, features.generate(prompts, 2, 1.0, 6, seed=2), proc.tokenizer)
    features.sync(new)
    synced = trainer_logp_diff(new, features.generate(prompts, 2, 1.0, 6, seed=2), proc.tokenizer)
    features.sync(model)  # back, for the family's other tests
    assert stale > STALE and synced < LOGP_TOL, (stale, synced)


def test_check_config_refuses_what_embeds_cannot_do():
    """vllm_embeds without a frozen tower or vLLM is refused before anything loads; with TP and SP it runs
    (test_shares' sp 4 / rollout_tp 2 run)."""
    m = tiny_model_dir()
    for kw, text in [
        (dict(), "needs freeze_vision and rollout vllm"),
        (dict(freeze_vision=True, rollout="hf"), "needs freeze_vision and rollout vllm"),
    ]:
        with pytest.raises(Exception, match=text):
            check_config(Config(model=m, vllm_embeds=True, **kw), world=2)
    check_config(Config(model=m, vllm_embeds=True, freeze_vision=True, rollout_tp=2), world=2)
    check_config(Config(model=m, vllm_embeds=True, freeze_vision=True, sp_size=2), world=2)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,tp", [(1, 1), (2, 2)])
def test_two_step_train_on_features(tmp_path, ranks, tp):
    """vLLM on features, 1 process, and 2 FSDP ranks in one TP group (each encodes its own prompts,
    the group gathers; 2 ranks with an engine each were checked once and left out for the suite's
    time): 2 steps train, the sampler's log-probs are the trainer's, and each step's media go through
    the tower once: 4 prompts, one video each (2 ranks: 2 a rank + the image dummy each, FSDP2's
    alignment); the held-out evaluation's encodes (step 0's) are not a step's."""
    out = tmp_path / "run"
    embeds = ["--freeze-vision", "--vllm-embeds", "--rollout-tp", str(tp)]
    cmd = train_cmd(tiny_model_dir(), color_data_dir(), out, *embeds)
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    result = subprocess.run(
        [*launch, *cmd],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    per_step = {1: 4, 2: 6}[ranks]
    assert [r["vision/encodes"] for r in rows] == [per_step, per_step]
    for r in rows:
        assert r["mismatch/max"] < LOGP_TOL and r["grad_norm"] > 0, r

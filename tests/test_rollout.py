"""rollout.py on a real vLLM engine and the real tiny Qwen2.5-VL checkpoint (no mocks).

    .venv/bin/python -m pytest -q tests/test_rollout.py

Checks: vLLM builds exactly the trainer's prompt ids; vLLM's sampled-token log-probs agree with the
trainer's recomputation on the same inputs; after a weight sync vLLM samples from the new weights;
the HF engine and vLLM agree on greedy outputs.
"""
import pytest
import torch
from conftest import tiny_config

import data
from rollout import HFEngine, VLLMEngine, vision_token_ids
from train import collate, token_logp

pytestmark = pytest.mark.slow  # a vLLM engine

# Measured on this CPU, both in fp32: per-token |diff| is zero-mean noise, mean ~7e-4, max 3.7e-3 over
# 192 tokens (vLLM's CPU kernels are not bit-identical to transformers' sdpa). A real bug (wrong M-RoPE
# positions, stale weights, temperature applied twice) moves log-probs by 0.1 or more.
LOGP_TOL = 1e-2


@pytest.fixture(scope="module")
def setup(tiny_model, synth):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    proc = AutoProcessor.from_pretrained(tiny_model)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()
    cfg = tiny_config()
    samples = [s for s in data.load_samples(f"{synth}/train.jsonl") if s.get("videos")][:4]
    prompts = [data.prepare(s, proc, cfg) for s in samples]
    engine = VLLMEngine(tiny_model, proc.tokenizer, max_model_len=1024, dtype="float32")
    return proc, model, prompts, engine


def test_logp_agree_with_trainer(setup):
    proc, model, prompts, engine = setup
    rollouts = engine.generate(prompts, n=4, temperature=1.0, max_tokens=12)
    assert len(rollouts) == 16 and all(r.response_ids and len(r.logp) == len(r.response_ids) for r in rollouts)
    banned = vision_token_ids(proc.tokenizer)
    assert not any(t in banned for r in rollouts for t in r.response_ids)
    b = collate(rollouts, proc.tokenizer.pad_token_id, proc.tokenizer, "cpu")
    with torch.no_grad():
        logp, ent = token_logp(model, b, 1.0, banned)
    ref = torch.zeros_like(logp)
    for i, r in enumerate(rollouts):
        ref[i, :len(r.logp)] = torch.tensor(r.logp)
    diff = ((logp - ref).abs() * b["mask"]).max().item()
    print(f"max |logp_vllm - logp_trainer| = {diff:.2e}")
    assert diff < LOGP_TOL
    assert (ent * b["mask"]).sum() > 0


def test_hf_engine_matches_vllm_greedy(setup):
    proc, model, prompts, engine = setup
    eos = model.generation_config.eos_token_id
    hf = HFEngine(model, proc.tokenizer, eos if isinstance(eos, list) else [eos])
    a = engine.generate(prompts, n=1, temperature=0.0, max_tokens=10)
    b = hf.generate(prompts, n=1, temperature=0.0, max_tokens=10)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]


def test_weight_sync_changes_samples(setup):
    proc, model, prompts, engine = setup
    # a zero lm_head makes every allowed token equally likely: logp = -log(#allowed) exactly
    new = type(model).from_pretrained(model.name_or_path, dtype=torch.float32)
    with torch.no_grad():
        new.lm_head.weight.zero_()
    engine.sync(new)
    rollouts = engine.generate(prompts[:2], n=4, temperature=1.0, max_tokens=6)
    expect = -torch.log(torch.tensor(float(len(engine.allowed)))).item()
    got = [lp for r in rollouts for lp in r.logp]
    assert max(abs(x - expect) for x in got) < 1e-4
    engine.sync(model)  # and back: greedy output equals the original model's again
    g1 = engine.generate(prompts[:2], n=1, temperature=0.0, max_tokens=6)
    eos = model.generation_config.eos_token_id
    g2 = HFEngine(model, proc.tokenizer, eos if isinstance(eos, list) else [eos]).generate(prompts[:2], 1, 0.0, 6)
    assert [r.response_ids for r in g1] == [r.response_ids for r in g2]

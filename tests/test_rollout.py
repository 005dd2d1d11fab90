"""rollout.py on a real vLLM engine and the real tiny Qwen2.5-VL checkpoint (no mocks).

    .venv/bin/python -m pytest -q tests/test_rollout.py

Checks: vLLM builds exactly the trainer's prompt ids; vLLM's sampled-token log-probs agree with the
trainer's recomputation on the same inputs; after a weight sync vLLM samples from the new weights;
the HF engine and vLLM agree on greedy outputs; 8 prompts x 8 (a step that chunked and crashed) runs with
per-request seeds; on 2 ranks the bucketed sync hands vLLM exactly the trainer's full weights. Qwen2-VL, Qwen3-VL-MoE,
Qwen3.5 (an engine each, one test): both samplers' log-probs on video and image, and the weight sync.
This file is also the torchrun worker of the 2-rank test (a run of conftest.shared_2_ranks' launch):

    torchrun --nproc_per_node=2 tests/test_rollout.py MODEL DATA.jsonl
"""

import os
import sys
import time

import pytest
import torch

sys.path[:0] = [
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(os.path.abspath(__file__)),
]
from conftest import (  # noqa: E402
    ROOT,
    SHARED_RUNS,
    another_engine,
    concat_media,
    tiny_config,
    trainer_logp_diff,
)

import data  # noqa: E402
from ckpt import full_tensors  # noqa: E402
import sp  # noqa: E402
from rollout import HFEngine, VLLMEngine, request_seed, vision_token_ids  # noqa: E402
from train import collate, token_logp  # noqa: E402

pytestmark = pytest.mark.slow  # a vLLM engine

# Measured on this CPU, both in fp32, 8-frame videos and images: max 9.5e-7 per token for Qwen2.5-VL and Qwen2-VL.
# A real bug moves log-probs more: transformers' own M-RoPE positions after 4 frame pairs 2.2e-3 to 3.5e-3 (LOG.md
# session 5), stale weights or the temperature applied twice 0.1 or more (STALE).
LOGP_TOL, STALE = 1e-4, 0.1


@pytest.fixture(scope="module")
def setup(tiny_model, synth):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()
    cfg = tiny_config()
    samples = [s for s in data.load_samples(f"{synth}/train.jsonl") if s.get("videos")][:4]
    prompts = [data.prepare(s, proc, cfg) for s in samples]
    engine = VLLMEngine(tiny_model, proc.tokenizer, max_model_len=1024, dtype="float32")
    yield proc, model, prompts, engine
    engine.close()  # vLLM's process group with it: a later module's engine starts as a first one


def hf_engine(model, tokenizer) -> HFEngine:
    eos = model.generation_config.eos_token_id
    return HFEngine(model, tokenizer, eos if isinstance(eos, list) else [eos])


def test_logp_agree_with_trainer(setup):
    proc, model, prompts, engine = setup
    rollouts = engine.generate(prompts, n=4, temperature=1.0, max_tokens=12, seed=1)
    assert len(rollouts) == 16 and all(
        r.response_ids and len(r.logp) == len(r.response_ids) for r in rollouts
    )
    banned = vision_token_ids(proc.tokenizer)
    assert not any(t in banned for r in rollouts for t in r.response_ids)
    b = collate(rollouts, proc.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logp, ent = token_logp(model, b, 1.0, banned)
    ref = torch.zeros_like(logp)
    for i, r in enumerate(rollouts):
        ref[i, : len(r.logp)] = torch.tensor(r.logp)
    diff = ((logp - ref).abs() * b.mask).max().item()
    print(f"max |logp_vllm - logp_trainer| = {diff:.2e}")
    assert diff < LOGP_TOL
    assert (ent * b.mask).sum() > 0


def test_hf_engine_matches_vllm_greedy(setup):
    proc, model, prompts, engine = setup
    eos = model.generation_config.eos_token_id
    hf = HFEngine(model, proc.tokenizer, eos if isinstance(eos, list) else [eos])
    a = engine.generate(prompts, n=1, temperature=0.0, max_tokens=10, seed=0)
    # one batch: left padding changes nothing
    b = hf.generate(prompts, n=1, temperature=0.0, max_tokens=10, seed=0)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]


def test_weight_sync_changes_samples(setup):
    proc, model, prompts, engine = setup
    # a zero lm_head makes every allowed token equally likely: logp = -log(#allowed) exactly
    new = type(model).from_pretrained(model.name_or_path, dtype=torch.float32)
    with torch.no_grad():
        new.lm_head.weight.zero_()
    engine.sync(new)
    rollouts = engine.generate(prompts[:2], n=4, temperature=1.0, max_tokens=6, seed=2)
    expect = -torch.log(torch.tensor(float(len(engine.allowed)))).item()
    got = [lp for r in rollouts for lp in r.logp]
    assert max(abs(x - expect) for x in got) < 1e-4
    engine.sync(model)  # and back: greedy output equals the original model's again
    g1 = engine.generate(prompts[:2], n=1, temperature=0.0, max_tokens=6, seed=0)
    g2 = hf_engine(model, proc.tokenizer).generate(prompts[:2], 1, 0.0, 6, seed=0)
    assert [r.response_ids for r in g1] == [r.response_ids for r in g2]


def test_eight_prompts_by_eight_images(setup, synth):
    """The step that crashed ("CPU Generator does not use offset"): 64 requests of an image prompt do not fit one
    engine step, and chunked prefill split one and rewound its CPU generator. Per-request seeds still hold."""
    proc, model, _, engine = setup
    samples = [s for s in data.load_samples(f"{synth}/train.jsonl") if s.get("images")][:8]
    prompts = [data.prepare(s, proc, tiny_config()) for s in samples]
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    # the step spans several engine steps
    assert len(prompts) == 8 and 64 * len(prompts[0].prompt_ids) > budget
    a = engine.generate(prompts, n=8, temperature=1.0, max_tokens=4, seed=3)
    assert len(a) == 64 and all(len(r.logp) == len(r.response_ids) > 0 for r in a)
    assert len({tuple(r.response_ids) for r in a}) > 8  # 64 draws, not one repeated per prompt
    # request i samples from request_seed(seed, rank, i): alone or within the step, prompt 0 samples the same
    b = engine.generate(prompts[:1], n=8, temperature=1.0, max_tokens=4, seed=3)
    assert [r.response_ids for r in b] == [r.response_ids for r in a[:8]]


def test_hf_engine_one_batch(setup, synth):
    """An image and a video prompt (different lengths, left-padded) x 3 rows in one generate call: rows come back
    grouped by prompt, their log-probs are the trainer's, and the call's seed alone decides the samples."""
    proc, model, prompts, _ = setup
    image = data.prepare(
        next(s for s in data.load_samples(f"{synth}/train.jsonl") if s.get("images")),
        proc,
        tiny_config(),
    )
    mixed = [image, prompts[0]]
    assert len(image.prompt_ids) != len(prompts[0].prompt_ids)
    hf = hf_engine(model, proc.tokenizer)
    a = hf.generate(mixed, 3, 1.0, 6, seed=5)
    assert [r.prompt for r in a] == [image] * 3 + [prompts[0]] * 3
    # the same fp32 model in the same library: only KV-cache vs full-forward rounding, ~1e-6
    assert trainer_logp_diff(model, a, proc.tokenizer) < 1e-4
    assert [r.response_ids for r in hf.generate(mixed, 3, 1.0, 6, seed=5)] == [
        r.response_ids for r in a
    ]
    assert [r.response_ids for r in hf.generate(mixed, 3, 1.0, 6, seed=6)] != [
        r.response_ids for r in a
    ]


def test_hf_engine_encodes_each_prompt_once(setup, synth):
    """Issue 21: the vision tower sees each distinct prompt's media once, not once per row, and sampling is unchanged:
    the same tokens and log-probs as transformers' generate handed every row's pixels (the engine before)."""
    proc, model, prompts, _ = setup
    image = data.prepare(
        next(s for s in data.load_samples(f"{synth}/train.jsonl") if s.get("images")),
        proc,
        tiny_config(),
    )
    mixed, n, tok = [image, prompts[0], prompts[1]], 4, proc.tokenizer
    hf = hf_engine(model, tok)
    seen = []  # (pixel rows, media items) per tower call
    hook = model.model.visual.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append((len(args[0]), len(kwargs["grid_thw"]))),
        with_kwargs=True,
    )
    try:
        got = hf.generate(mixed, n, 1.0, 6, seed=7)
    finally:
        hook.remove()
    # one call per modality, over one copy of each prompt's media (not n copies)
    assert sorted(seen) == sorted(
        [
            (len(image.mm["pixel_values"]), 1),
            (sum(len(p.mm["pixel_values_videos"]) for p in mixed[1:]), 2),
        ]
    )
    # before: every row's pixels to generate, which encodes them all (left padding, same seed, same config)
    rows = [p for p in mixed for _ in range(n)]
    P = max(len(r.prompt_ids) for r in rows)
    ids = torch.tensor([[tok.pad_token_id] * (P - len(r.prompt_ids)) + r.prompt_ids for r in rows])
    attn = (
        torch.arange(P)[None] >= torch.tensor([P - len(r.prompt_ids) for r in rows])[:, None]
    ).long()
    torch.manual_seed(request_seed(7, 0))
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            **concat_media(rows),
            position_ids=sp.mrope_positions(ids, attn, data.grids(rows, "cpu"), model.config),
            generation_config=hf.config(1.0, 6),
        )
    for i, r in enumerate(got):
        k = len(r.response_ids)
        assert r.response_ids == out.sequences[i, P : P + k].tolist()
        logits = torch.stack([step[i] for step in out.logits[:k]]).float()
        logits[:, hf.banned] = float("-inf")
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logp), ref, atol=1e-5, rtol=0)


def test_two_rank_sync_is_exact(shared_2_ranks):
    """FSDP2 on 2 ranks (torchrun, gloo): the bucketed gather returns every full tensor exactly (uneven and empty
    shards included), vLLM then holds the trainer's weights, and its log-probs agree with the trainer's again.
    worker() below, the last run of conftest.shared_2_ranks' launch."""
    _, result = shared_2_ranks
    log = result.log(SHARED_RUNS.index("sync"))
    assert log.count("SYNC OK") == 2, log[-5000:]


# vLLM 0.32's CPU gated delta-net kernel is bf16-only (rollout.vllm_settings): Qwen3.5's engines sample in bf16, the
# trainer recomputes in fp32. Measured max (mean) per token: Qwen3.5 3.4e-3 (1.1e-3), Qwen3.5-MoE 4.0e-2 (1.8e-3: a
# routing choice flipped by bf16 moves a token); the fp32 families 9.5e-7 (2.4e-7), Qwen3-VL-MoE's too
BF16_TOL = {"qwen3_5": 1e-2, "qwen3_5_moe": 0.1}


# Qwen3.5-MoE's engine is left out for the suite's time (its gated delta-net is Qwen3.5's, its experts Qwen3-VL-MoE's;
# measured once with it: docs/families.md); add "qwen3_5_moe" to check it again
@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl_moe", "qwen3_5"])
def family(request, synth):
    """Qwen2-VL (issue 32: full-attention tower, M-RoPE time = the frame pair's index, no timestamps), Qwen3-VL-MoE
    and Qwen3.5 (issue 42: experts, linear attention): processor, model, 2 video prompts and an image
    prompt, and an engine of its own (one per family, for all its checks)."""
    import make_tiny_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d = make_tiny_model.ensure(request.param, root=os.path.join(ROOT, ".cache/models"))
    proc = AutoProcessor.from_pretrained(d)
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    samples = data.load_samples(f"{synth}/train.jsonl")
    picked = [s for s in samples if s.get("videos")][:2] + [
        next(s for s in samples if s.get("images"))
    ]
    # 8 frames, 4 frame pairs: the text after the video follows the last pair's time position, past its rows/columns
    prompts = [data.prepare(s, proc, tiny_config(model=d)) for s in picked]
    assert (
        prompts[0].mm["video_grid_thw"][0].tolist()[0] == 4
        and "second_per_grid_ts" not in prompts[0].mm
    )
    engine = another_engine(d, proc.tokenizer)  # the module's `setup` has one
    yield request.param, proc, model, prompts, engine
    engine.close()


def test_samplers_agree_with_trainer(family):
    """Video and image prompts: vLLM builds the processor's prompt ids (else generate raises) and its log-probs are
    the trainer's (LOGP_TOL; Qwen3.5 BF16_TOL), the HF engine's too (the same library), and after a weight sync
    vLLM samples from the new weights (MoE: its experts packed again on the CPU)."""
    arch, proc, model, prompts, engine = family
    tol = BF16_TOL.get(arch, LOGP_TOL)
    rollouts = engine.generate(prompts, n=4, temperature=1.0, max_tokens=12, seed=1)
    assert len(rollouts) == 12 and all(len(r.logp) == len(r.response_ids) > 0 for r in rollouts)
    for kind in ("video", "image"):
        rows = [r for r in rollouts if f"{kind}_grid_thw" in r.prompt.mm]
        b = collate(rows, proc.tokenizer.pad_token_id, "cpu")
        with torch.no_grad():
            logp, _ = token_logp(model, b, 1.0, vision_token_ids(proc.tokenizer))
        gap = (logp - torch.nan_to_num(b.rollout_logp)).abs() * b.mask
        diff = gap.max().item()
        print(
            f"{arch} {kind}: |logp_vllm - logp_trainer| max {diff:.2e} mean {gap.sum() / b.mask.sum():.2e}"
        )
        assert diff < tol, kind
    hf = hf_engine(model, proc.tokenizer)
    assert trainer_logp_diff(model, hf.generate(prompts, 3, 1.0, 6, seed=5), proc.tokenizer) < 1e-4
    # every weight reaches vLLM under its name (the tower's qkv, fc1/fc2, LayerNorms): noise moves the trainer, the
    # sync moves vLLM with it (0.01: test_two_rank_sync_is_exact's scale)
    new = type(model).from_pretrained(model.name_or_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.01 * torch.randn_like(p))
    stale = trainer_logp_diff(new, engine.generate(prompts, 2, 1.0, 6, seed=2), proc.tokenizer)
    start = time.perf_counter()
    engine.sync(new)
    took = time.perf_counter() - start
    synced = trainer_logp_diff(new, engine.generate(prompts, 2, 1.0, 6, seed=2), proc.tokenizer)
    print(f"{arch} sync: stale {stale:.2e}, synced {synced:.2e}, {took:.2f} s")
    assert stale > STALE and synced < tol, (stale, synced)


def vllm_weights(worker) -> dict:
    """vLLM's weights as it holds them; on CPU most linear layers keep only a packed oneDNN copy (an empty .weight)."""
    return {
        n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters() if p.numel()
    }


def hf_name(name: str) -> str:
    """vLLM and transformers name the same weight with different prefixes: compare without them."""
    return ".".join(x for x in name.split(".") if x not in ("model", "language_model"))


FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}  # vLLM: concatenated


def worker(model_dir: str, data_path: str):
    import train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import AutoProcessor

    rank, world, device = train.init_dist()
    # uneven shards (5 and 7 rows), an empty one (1 row), two dtypes, a plain tensor; budgets of 1 byte (every tensor
    # a bucket of its own) and 1 MB (consecutive float32 tensors share one collective)
    full = {
        "a": torch.arange(15.0).reshape(5, 3),
        "b": torch.arange(4.0)[None],
        "c": torch.arange(6.0).reshape(3, 2),
        "d": torch.arange(14, dtype=torch.float64).reshape(7, 2),
        "plain": torch.ones(2),
    }
    mesh = init_device_mesh(device.type, (world,))
    sharded = {
        k: v if k == "plain" else distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()
    }
    assert sharded["b"].to_local().shape == ((1, 4), (0, 4))[rank]
    for bucket_bytes in (1, 2**20):
        got = list(full_tensors(sharded, bucket_bytes))
        assert [k for k, _ in got] == list(full) and all(torch.equal(v, full[k]) for k, v in got), (
            bucket_bytes
        )
    cfg = tiny_config(model=model_dir)
    proc = AutoProcessor.from_pretrained(model_dir)
    tok = proc.tokenizer
    model = train.load_model(cfg, device)
    torch.manual_seed(rank)
    # "trained" weights, not the checkpoint vLLM loaded; 0.01: noise of 0.05 sharpens the policy so
    # much that the two engines' fp32 kernels disagree by 0.06 (kernel noise grows with the logits)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(0.01 * torch.randn_like(p.to_local()))
    state = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in model.state_dict().items()
    }
    assert all(torch.equal(v, state[k]) for k, v in full_tensors(model.state_dict()))
    engine = VLLMEngine(model_dir, tok, max_model_len=1024, dtype="float32")
    samples = [s for s in data.load_samples(data_path) if s.get("videos")][2 * rank : 2 * rank + 2]
    prompts = [data.prepare(s, proc, cfg) for s in samples]
    dummies = data.dummy_prompts(proc)

    def logp_diff() -> float:
        rollouts = engine.generate(prompts, 2, 1.0, 6, seed=0)
        b = collate(rollouts, tok.pad_token_id, device, dummies)
        with torch.no_grad():
            logp = token_logp(model, b, 1.0, vision_token_ids(tok))[0]
        ref = torch.zeros_like(logp)
        for i, r in enumerate(rollouts):
            ref[i, : len(r.logp)] = torch.tensor(r.logp)
        return ((logp - ref).abs() * b.mask).max().item()

    before = logp_diff()
    engine.sync(model)
    after = logp_diff()
    by_name = {hf_name(k): v for k, v in state.items()}
    held = engine.llm.collective_rpc(vllm_weights)[0]
    for name, v in held.items():
        fused = [name.replace(f, part) for f, parts in FUSED.items() if f in name for part in parts]
        expect = torch.cat([by_name[hf_name(x)] for x in fused or [name]])
        # vLLM pads the vocabulary rows (452 -> 512 here): compare the real rows
        assert torch.equal(v.flatten()[: expect.numel()], expect.flatten()), name
    assert before > STALE and after < LOGP_TOL, (before, after)
    print(
        f"SYNC OK rank {rank}: {len(held)} vLLM weights equal; |dlogp| {before:.3f} before sync, {after:.1e} after"
    )


if __name__ == "__main__":
    worker(*sys.argv[1:3])

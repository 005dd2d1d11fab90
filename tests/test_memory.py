"""Real-scale memory (issue 13): the vision tower once per distinct media item, chunked log-probs.

Each path is checked against the plain transformers forward (every row carries its own copy of the media, full
logits), in float32, on every tiny checkpoint.

    .venv/bin/python -m pytest -q tests/test_memory.py
"""

import os

import pytest
import torch
from conftest import ROOT, concat_media, tiny_config

import data
import sp
import train
from rollout import Rollout, vision_token_ids


# Qwen3.5-MoE stands for the newer families (the suite's time): its gated delta-net layers are Qwen3.5's, its
# routers and experts Qwen3-VL-MoE's (one transformers MoE block and load-balancing loss)
@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5_moe"])
def setup(request, synth):
    """Model, processor and 7 rows: a video prompt x 2, an image prompt x 2, image+video x 2, text x 1."""
    import make_tiny_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d = make_tiny_model.ensure(request.param, root=os.path.join(ROOT, ".cache/models"))
    processor = AutoProcessor.from_pretrained(d)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
    samples = data.load_samples(os.path.join(synth, "train.jsonl"))
    video = next(s for s in samples if s.get("videos"))
    image = next(s for s in samples if s.get("images"))
    both = dict(video, id="both", images=image["images"], data_type="video")
    text = dict(video, id="text", videos=[], data_type="text")
    cfg = tiny_config(model=d)
    prompts = [data.prepare(s, processor, cfg) for s in (video, image, both, text)]
    responses = [[30, 31, 32], [40], [50, 51], [60, 61, 62, 63], [70, 71], [], [80, 81]]
    owner = [0, 0, 1, 1, 2, 2, 3]
    rows = [Rollout(prompts[k], ids, None, "", "stop") for k, ids in zip(owner, responses)]
    return model, processor, rows


def positions(model, b) -> torch.Tensor:
    """The M-RoPE positions the trainer uses (vLLM's; transformers 5.19's differ after 3+ frame pairs): (3, B, S)."""
    return sp.mrope_positions(b.input_ids, b.attention_mask, b.grids, model.config)


def per_row_logp(model, b, rows, banned):
    """Today's path, from the model's own forward: every row carries its media, full (B, R, V) logits."""
    mm = concat_media([r.prompt for r in rows])
    R = b.mask.shape[1]
    logits = (
        model(
            input_ids=b.input_ids,
            attention_mask=b.attention_mask,
            logits_to_keep=R + 1,
            position_ids=positions(model, b),
            **mm,
        )
        .logits[:, :-1]
        .float()
    )
    logits[..., banned] = -1e9
    return torch.log_softmax(logits, -1).gather(-1, b.response_ids.unsqueeze(-1)).squeeze(-1)


def loss_and_grads(model, logp, mask):
    """A loss that weighs every token differently, and the gradient of every parameter."""
    model.zero_grad(set_to_none=True)
    weights = torch.arange(1, mask.numel() + 1, dtype=torch.float32).view_as(mask) / mask.numel()
    (-(logp * mask * weights).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict):
    """Every gradient within 1e-5 of its largest entry; the gated delta-net's per-head scalars (dt_bias, A_log: each a
    sum over every token) within 1e-4 (measured 3.4e-5)."""
    assert got.keys() == want.keys()
    for k in want:
        scale = want[k].abs().max().item()
        tol = 1e-4 if "linear_attn" in k else 1e-5
        gap = (got[k] - want[k]).abs().max().item()
        msg = f"{k}: {gap:.2e} of {scale:.2e}"
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=tol * scale, msg=msg)


def test_vision_once_per_prompt_matches_per_row_forward(setup):
    model, processor, rows = setup
    tok, banned = processor.tokenizer, vision_token_ids(processor.tokenizer)
    b = train.collate(rows, tok.pad_token_id, torch.device("cpu"))
    ref = per_row_logp(model, b, rows, banned)
    ref_grads = loss_and_grads(model, ref, b.mask)
    counts = train.Counts()
    logp, ent = train.token_logp(model, b, 1.0, banned, chunk=4, counts=counts)
    assert counts.encodes == 4  # 1 video + 1 image + (1 image + 1 video); 7 rows would be 8 items
    torch.testing.assert_close(logp * b.mask, ref * b.mask, rtol=0, atol=1e-5)
    grads = loss_and_grads(model, logp, b.mask)
    assert grads.keys() == ref_grads.keys()
    assert any(
        k.startswith("model.visual.blocks") and ref_grads[k].abs().sum() > 0 for k in ref_grads
    )
    assert_grads_close(grads, ref_grads)


def test_chunked_logp_and_entropy_match_full_logits(setup):
    """Chunks of 3 positions (rows cut mid-way), backward by hand, vs autograd through the full logits with log-prob
    and entropy -sum p log p from their definitions (banned vision tokens excluded), temperature 0.7: values and
    gradients, float32."""
    model, processor, rows = setup
    tok, banned = processor.tokenizer, vision_token_ids(processor.tokenizer)
    b = train.collate(rows, tok.pad_token_id, torch.device("cpu"))
    R = b.mask.shape[1]
    mm = concat_media(b.prompts)
    logits = (
        model(
            input_ids=b.input_ids,
            attention_mask=b.attention_mask,
            logits_to_keep=R + 1,
            position_ids=positions(model, b),
            **mm,
        ).logits[:, :-1]
        / 0.7
    )
    keep = torch.ones(logits.shape[-1], dtype=torch.bool)
    keep[banned] = False
    logq = torch.log_softmax(logits[..., keep], -1)  # over the allowed tokens
    place = keep.long().cumsum(0) - 1  # a token's index in logq
    ref_logp = logq.gather(-1, place[b.response_ids].unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logq.exp() * logq).sum(-1)
    out = []
    for logp, ent in ((ref_logp, ref_ent), train.token_logp(model, b, 0.7, banned, chunk=3)):
        model.zero_grad(set_to_none=True)
        weights = torch.linspace(0.5, 1.5, b.mask.numel()).view_as(b.mask) * b.mask
        ((logp * weights).sum() + 0.3 * (ent * weights.flip(-1)).sum()).backward()
        out.append(
            (
                logp.detach() * b.mask,
                ent.detach() * b.mask,
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    (logp0, ent0, g0), (logp3, ent3, g3) = out
    torch.testing.assert_close(logp3, logp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent3, ent0, rtol=0, atol=1e-5)
    assert_grads_close(g3, g0)
    one = train.collate(rows, tok.pad_token_id, torch.device("cpu"))
    logp_one, ent_one = train.token_logp(model, one, 0.7, banned, chunk=0)  # all positions at once
    torch.testing.assert_close(logp_one * b.mask, logp3, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_one * b.mask, ent3, rtol=0, atol=1e-6)


def test_activation_checkpointing_same_gradients_recomputes(setup):
    """gradient_checkpointing: every decoder layer and vision block runs again in backward (counted by a forward
    pre-hook), and the gradients equal those without it (float32)."""
    model, processor, rows = setup
    tok, banned = processor.tokenizer, vision_token_ids(processor.tokenizer)
    d = model.config._name_or_path
    out = []
    for on in (False, True):
        torch.manual_seed(0)
        m = train.load_model(tiny_config(model=d, gradient_checkpointing=on), torch.device("cpu"))
        calls = []
        for block in (m.model.language_model.layers[0], m.model.visual.blocks[0]):
            # a pre-hook: the recomputation stops once it has what backward needs, before any forward hook
            block.register_forward_pre_hook(lambda mod, args: calls.append(type(mod).__name__))
        b = train.collate(rows, tok.pad_token_id, torch.device("cpu"))
        logp, _ = train.token_logp(m, b, 1.0, banned)
        n_forward = len(calls)
        grads = loss_and_grads(m, logp, b.mask)
        out.append((logp.detach(), grads, n_forward, len(calls)))
    (logp0, g0, fwd0, total0), (logp1, g1, fwd1, total1) = out
    # layer 0 once, vision block 0 once for the images and once for the videos; all again in backward
    assert fwd0 == fwd1 == 3 and total0 == 3 and total1 == 6
    torch.testing.assert_close(logp1, logp0, rtol=0, atol=0)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-6, atol=1e-7, msg=k)


def test_offload_is_an_error_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="offload"):
        train.check_config(tiny_config(offload=True))


def test_router_aux_loss_is_transformers(setup):
    """router_aux_loss (MoE): micro_loss adds router_aux_loss_coef x transformers' own aux_loss of the same forward
    (output_router_logits, padding masked out), logged as router_aux; a dense model is refused before it loads."""
    model, processor, rows = setup
    d = model.config._name_or_path
    if not hasattr(model.config.get_text_config(), "num_experts_per_tok"):
        with pytest.raises(ValueError, match="has no routers"):
            train.check_config(tiny_config(model=d, router_aux_loss=True))
        return
    tok, banned = processor.tokenizer, vision_token_ids(processor.tokenizer)
    b = train.collate(rows, tok.pad_token_id, torch.device("cpu"))
    b.adv = torch.ones_like(b.mask)
    b.n_tok = b.mask.sum().item()
    b.n_seq = 1.0
    got = {}
    for on in (False, True):
        cfg = tiny_config(model=d, rollout="hf", router_aux_loss=on, router_aux_loss_coef=0.5)
        train.check_config(cfg)
        loss, metrics = train.micro_loss(model, b, cfg, banned)
        got[on] = (loss.item(), metrics["router_aux"])
    mm = concat_media([r.prompt for r in rows])
    with torch.no_grad():
        out = model(
            input_ids=b.input_ids,
            attention_mask=b.attention_mask,
            position_ids=positions(model, b),
            output_router_logits=True,
            **mm,
        )
    assert got[False][1] == 0 and got[True][1] > 0
    torch.testing.assert_close(got[True][1], out.aux_loss.item(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got[True][0] - got[False][0], 0.5 * got[True][1], rtol=1e-4, atol=0)

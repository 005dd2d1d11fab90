"""One encode per prompt (issue 40): the trained tower once per mini-batch with its feature gradient
summed over the micro-batches (sp.Towers), the reference's features kept per sample
(sp.FeatureCache), a frozen tower once per step and never recomputed under checkpointing. Each
against the path before it (every micro-batch encodes its prompts), in float32, one process, on
every tiny checkpoint; test_sp.py checks the SP ranks against the same path.

    .venv/bin/python -m pytest -q tests/test_encode.py
"""

import os
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, global_counts, reference_logp, tiny_config

import data
import sp
import train
from rollout import Rollout

GROUP = 3  # rows per prompt; one row per micro-batch: a group spans its mini-batch's micro-batches


def build(arch: str, synth: str, **kw):
    """A train.Trainer (kl_coef: with a reference) and its config on the tiny checkpoint `arch`, and
    9 rows: a video prompt, an image prompt, image+video, GROUP rows each."""
    import make_tiny_model
    from transformers import AutoProcessor

    d = make_tiny_model.ensure(arch, root=os.path.join(ROOT, ".cache/models"))
    settings = dict(
        model=d,
        group_size=GROUP,
        prompts_per_step=3,
        micro_batch_size=1,
        mini_batches=2,
        kl_coef=0.1,
        entropy_coef=0.1,
        grad_clip=1e9,  # no clipping: the gradient the optimizer sees is the loss's
        temperature=0.7,
    )
    cfg = tiny_config(**(settings | kw))
    processor = AutoProcessor.from_pretrained(d)
    torch.manual_seed(0)
    t = train.build_trainer(cfg, processor, sp.make_layout(1), torch.device("cpu"))
    samples = data.load_samples(os.path.join(synth, "train.jsonl"))
    video = next(s for s in samples if s.get("videos"))
    image = next(s for s in samples if s.get("images"))
    both = dict(video, id="both", images=image["images"], data_type="video")
    prompts = [data.prepare(s, processor, cfg) for s in (video, image, both)]
    g = torch.Generator().manual_seed(0)
    rows = []
    for p in prompts:
        for k in range(GROUP):
            ids = torch.randint(20, 400, (2 + k,), generator=g).tolist()
            rows.append(Rollout(p, ids, None, "", "stop"))
    return t, cfg, processor.tokenizer, rows


def step_batches(t, cfg, tok, rows) -> list[list[train.MicroBatch]]:
    """train.main's micro-batches with advantages (+-1 by row)."""
    minibatches = train.micro_batches(rows, cfg, tok, t.device, t.dummies)
    for b in [b for mini in minibatches for b in mini]:
        adv = torch.tensor(b.index) % 2 * 2.0 - 1
        b.adv = adv[:, None].expand_as(b.mask)
    return minibatches


def update_grads(t, cfg, minibatches) -> list[dict]:
    """train.update's gradient at each optimizer step (the step itself skipped: weights unchanged)."""
    grads = []

    def record():
        grads.append(
            {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        )

    t.opt.step = record
    train.update(t, minibatches, cfg, step=1, ids=[])
    return grads


def per_micro_batch(t, cfg, minibatches) -> tuple[list, list]:
    """The path before: every micro-batch encodes its prompts, in each pass. Each micro-batch's
    old and reference log-probs, and each mini-batch's gradient."""
    logps = []
    grads = []
    args = (cfg.temperature, t.banned, cfg.logp_chunk, t.layout)
    for mini in minibatches:
        n_tok, n_seq = global_counts(mini)
        for b in mini:
            plain = replace(b, vision=None, n_tok=n_tok, n_seq=n_seq)
            with torch.no_grad():
                old = train.token_logp(t.model, plain, *args)[0]
                ref = reference_logp(t.model, t.ref, plain, *args)
            logps.append((old, ref))
            loss, _ = train.micro_loss(t.model, plain, cfg, t.banned)
            loss.backward()
        grads.append(
            {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        )
        t.model.zero_grad(set_to_none=True)
    return logps, grads


def count_calls(modules: list) -> list:
    """One entry per forward call of any of `modules` (checkpointing's recomputes included)."""
    calls = []
    for m in modules:
        m.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    return calls


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_encode_once_matches_per_micro_batch(arch, synth):
    """Trained tower, kl_coef, 2 mini-batches of 1-row micro-batches (a group's rows in several):
    old and reference log-probs and each optimizer step's gradient equal the per-micro-batch path
    (fp32, 1e-5); the policy's tower runs once before the update and on each prompt once per
    mini-batch, the reference's once per sample (a second step: not at all)."""
    t, cfg, tok, rows = build(arch, synth)
    minibatches = step_batches(t, cfg, tok, rows)
    assert sum(len(mini) for mini in minibatches) == len(rows)
    towers = count_calls([t.model.model.visual])
    ref_towers = count_calls([t.ref.model.visual])
    counts = train.Counts()
    train.logp_pass(t, minibatches, rows, cfg, counts)
    grads = update_grads(t, cfg, minibatches)
    # rows A A A B | B B C C C: the no-grad encode (a call per modality), then each prompt at its
    # first micro-batch of each mini-batch (A, B | B, C: 2 calls); the reference's, once
    assert len(towers) == 2 + 2 + 3
    assert len(ref_towers) == 2
    assert counts.encodes == 2 * 4  # pieces: 2 videos + 2 images, policy and reference
    want_logps, want_grads = per_micro_batch(t, cfg, minibatches)
    for b, (old, ref) in zip([b for mini in minibatches for b in mini], want_logps):
        torch.testing.assert_close(b.old_logp, old, rtol=0, atol=1e-5)
        torch.testing.assert_close(b.ref_logp, ref, rtol=0, atol=1e-5)
    assert len(grads) == len(want_grads) == cfg.mini_batches
    assert any(n.startswith("model.visual") and g.abs().sum() > 0 for n, g in grads[0].items())
    for got, want in zip(grads, want_grads):
        assert got.keys() == want.keys()
        for n, g in want.items():
            torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-5 * g.abs().max().item())
    # the next step: the same samples, the reference's features kept
    ref_towers.clear()
    again = step_batches(t, cfg, tok, rows)
    train.logp_pass(t, again, rows, cfg, train.Counts())
    assert ref_towers == []
    for b, first in zip([b for mini in again for b in mini], [b for m in minibatches for b in m]):
        torch.testing.assert_close(b.ref_logp, first.ref_logp, rtol=0, atol=0)
    # a cache of 0 bytes keeps a step's features for that step alone: the tower runs again
    t.ref_features.max_bytes = 0
    train.logp_pass(
        t, step_batches(t, cfg, tok, rows), rows, cfg, train.Counts()
    )  # kept from before, then dropped
    assert ref_towers == [] and t.ref_features.pieces == {} and t.ref_features.bytes == 0
    train.logp_pass(t, step_batches(t, cfg, tok, rows), rows, cfg, train.Counts())
    assert len(ref_towers) == 2 and t.ref_features.pieces == {}


def test_frozen_tower_once_and_never_recomputed(synth):
    """freeze_vision with activation checkpointing: the tower's blocks run once per step (the
    no-grad encode every pass reads), never again in the update or its backward; the trained
    tower's blocks are checkpointed (recomputed in the backward of each mini-batch's encode)."""
    t, cfg, tok, rows = build("qwen2_5_vl", synth, freeze_vision=True, gradient_checkpointing=True)
    blocks = list(t.model.model.visual.blocks)
    calls = count_calls(blocks)
    minibatches = step_batches(t, cfg, tok, rows)
    train.logp_pass(t, minibatches, rows, cfg, train.Counts())
    update_grads(t, cfg, minibatches)
    assert len(calls) == 2 * len(blocks)  # one encode per modality, for every pass
    trained, cfg, tok, rows = build("qwen2_5_vl", synth, gradient_checkpointing=True)
    blocks = list(trained.model.model.visual.blocks)
    calls = count_calls(blocks)
    minibatches = step_batches(trained, cfg, tok, rows)
    train.logp_pass(trained, minibatches, rows, cfg, train.Counts())
    update_grads(trained, cfg, minibatches)
    # the no-grad encode (2 calls), then 5 encodes with gradient (see above) and their recomputes
    assert len(calls) == len(blocks) * (2 + 2 * 5)


def test_reference_features_on_disk(tmp_path, synth):
    """feature_cache_dir: a first run writes the reference tower's features (an entry per sample and modality); a
    later run (an empty cache, the stamp of the same reference weights) reads them, never runs its reference tower,
    and gets the same reference log-probs, bit for bit; an entry edited on disk fails its checksum and is encoded and
    written again; other reference weights make other keys."""
    t, cfg, tok, rows = build("qwen2_5_vl", synth, feature_cache_dir=str(tmp_path))
    first = step_batches(t, cfg, tok, rows)
    train.logp_pass(t, first, rows, cfg, train.Counts())
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == 4 and t.ref_features.reads == 0  # video, image, video + image
    # a later run: its cache empty, its stamp from the same reference weights
    stamp = train.reference_stamp(cfg, t.ref)
    assert stamp == t.ref_features.stamp
    t.ref_features = sp.FeatureCache(folder=str(tmp_path), stamp=stamp)
    ref_towers = count_calls([t.ref.model.visual])
    again = step_batches(t, cfg, tok, rows)
    counts = train.Counts()
    train.logp_pass(t, again, rows, cfg, counts)
    assert ref_towers == [] and t.ref_features.reads == 4 and counts.encodes == 4  # the policy's
    flat = [b for mini in first for b in mini]
    for b, want in zip([b for mini in again for b in mini], flat):
        assert torch.equal(b.ref_logp, want.ref_logp)
    edited = bytearray(files[0].read_bytes())
    edited[-1] ^= 1
    files[0].write_bytes(bytes(edited))
    t.ref_features = sp.FeatureCache(folder=str(tmp_path), stamp=stamp)
    train.logp_pass(t, step_batches(t, cfg, tok, rows), rows, cfg, train.Counts())
    assert len(ref_towers) >= 1 and t.ref_features.reads == 3
    assert files[0].read_bytes() != bytes(edited)  # written again, whole
    with torch.no_grad():
        next(t.ref.model.visual.parameters()).add_(1e-3)
    assert train.reference_stamp(cfg, t.ref)["weights"] != stamp["weights"]

"""Joint image-video training: per-modality pixel budgets, image + video in one sample, text-only samples,
and the zero-weight vision input that keeps FSDP's collectives aligned.

    .venv/bin/python -m pytest -q tests/test_joint.py
"""

import os
import shutil

import numpy as np
import pytest
import torch
from conftest import SHARED_RUNS, background, lane_result, synth_dir, tiny_config, tiny_model_dir
from PIL import Image

import cache
import data


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def processor(request):
    """Each tiny checkpoint's processor: patch 14 (28 px per merged token) and 16 (32 px)."""
    import make_tiny_model
    from transformers import AutoProcessor

    root = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache/models"
    )
    return AutoProcessor.from_pretrained(make_tiny_model.ensure(request.param, root=root))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A 224x224 PNG and a 2 s 4 fps 224x224 mp4: big enough for each budget to decide the size."""
    import make_synthetic_data

    d = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(d / "im.png")
    make_synthetic_data.write_video(
        str(d / "v.mp4"), rng.integers(0, 255, (8, 224, 224, 3), dtype=np.uint8), fps=4
    )
    return d


def sample(**kw):
    s = dict(
        id="s",
        problem="What color?",
        answer="A",
        problem_type="multiple choice",
        options=["A. red", "B. green", "C. blue", "D. yellow"],
    )
    return data.validate_sample(dict(s, **kw), "mem.jsonl:1")


def test_each_modality_gets_its_own_pixel_budget(processor, media):
    f = cache.vision_factor(processor)  # 28: one merged token per 28x28 pixels
    cfg = tiny_config(
        image_min_pixels=f * f,
        image_max_pixels=36 * f * f,
        video_min_pixels=f * f,
        video_max_pixels=4 * f * f,
        video_fps=4.0,
        video_max_frames=8,
    )
    p = data.prepare(
        sample(images=[str(media / "im.png")], videos=[str(media / "v.mp4")]), processor, cfg
    )
    (_, ih, iw), (vt, vh, vw) = (
        p.mm["image_grid_thw"][0].tolist(),
        p.mm["video_grid_thw"][0].tolist(),
    )
    patch = processor.image_processor.patch_size
    assert (ih * patch) * (iw * patch) == 36 * f * f  # 224x224 -> 168x168 under the image budget
    assert (vh * patch) * (vw * patch) == 4 * f * f  # -> 56x56 under the (smaller) video budget
    assert vt == 8 // 2  # 8 frames, temporal patch 2
    # both placeholders are in the prompt, each expanded to its own feature count
    tok = processor.tokenizer
    merge2 = processor.image_processor.merge_size**2
    assert p.prompt_ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == ih * iw // merge2
    assert p.prompt_ids.count(tok.convert_tokens_to_ids("<|video_pad|>")) == vt * vh * vw // merge2
    # and vLLM is handed the very same pixels
    req = data.vllm_input(p)
    assert np.asarray(req["multi_modal_data"]["image"]).shape == (ih * patch, iw * patch, 3)
    assert req["multi_modal_data"]["video"][0].shape == (8, vh * patch, vw * patch, 3)


def test_several_images_and_text_only(processor, media):
    cfg = tiny_config()
    im = str(media / "im.png")
    p = data.prepare(sample(images=[im, im, im]), processor, cfg)
    assert p.mm["image_grid_thw"].shape[0] == 3 and len(p.images) == 3
    t = data.prepare(sample(data_type="text"), processor, cfg)
    assert t.mm == {} and not t.videos and not t.images
    pad_ids = {
        processor.tokenizer.convert_tokens_to_ids(x) for x in ("<|image_pad|>", "<|video_pad|>")
    }
    assert not pad_ids & set(t.prompt_ids)


def test_marker_places_media_in_the_prompt(processor, media):
    s = sample(
        problem="Look at <image> and then at <video>. Which matches?",
        images=[str(media / "im.png")],
        videos=[str(media / "v.mp4")],
    )
    p = data.prepare(s, processor, tiny_config())
    text = p.text
    assert (
        text.index("Look at")
        < text.index("<|image_pad|>")
        < text.index("and then at")
        < text.index("<|video_pad|>")
    )


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_dummies_touch_every_parameter_and_change_nothing(arch):
    """The dummy image and video, run through the tower with weight 0 (no decoder row: the micro-batch stays 1 row),
    give every parameter a gradient tensor (so FSDP reduce-scatters it on every rank) and leave every gradient value
    as it was."""
    import make_tiny_model
    import sp
    import train
    from rollout import Rollout, vision_token_ids
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d = make_tiny_model.ensure(
        arch, root=os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache/models")
    )
    proc, model = AutoProcessor.from_pretrained(d), AutoModelForImageTextToText.from_pretrained(d)
    tok = proc.tokenizer
    text = data.prepare(sample(data_type="text"), proc, tiny_config(model=d))
    rows = [Rollout(text, [30, 31, 32], None, "", "stop")]
    grads = []
    for dummies in (None, data.dummy_prompts(proc)):
        model.zero_grad(set_to_none=True)
        b = train.collate(rows, tok.pad_token_id, "cpu", dummies)
        assert b.input_ids.shape[0] == b.mask.shape[0] == 1
        # one row, no padding: no mask at all (the kernel's causal mode, no (B, 1, S, S) tensor)
        inputs, _ = sp.model_inputs(model, b, sp.encode_vision(model, b.prompts, "cpu"), None)
        assert inputs["attention_mask"] is None
        counts = train.Counts()
        logp, _ = train.token_logp(model, b, 1.0, vision_token_ids(tok), counts=counts)
        assert counts.encodes == (0 if dummies is None else 2)
        (-(logp * b.mask).sum()).backward()
        grads.append({n: q.grad for n, q in model.named_parameters()})
    assert any(g is None for g in grads[0].values())  # text alone leaves the vision tower out
    for n, g in grads[1].items():
        assert g is not None, n
        ref = grads[0][n] if grads[0][n] is not None else torch.zeros_like(g)
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


@background("grads_reference")
def grads_reference_job(tmp_path_factory):
    """tests/grad_worker.py, one process for both cases: the one-process references (split, uneven), in conftest's
    background lane. Returns its folder (ref-{case}.safetensors)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("grads")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [
        sys.executable,
        "tests/grad_worker.py",
        tiny_model_dir(),
        os.path.join(synth_dir(), "train.jsonl"),
        str(out / "ref-{case}.safetensors"),
        "split,uneven",
    ]

    def run():
        p = subprocess.run(
            cmd,
            cwd=root,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stdout[-6000:]
        return out

    return run


@pytest.fixture(scope="module")
def grads_reference(tmp_path_factory):
    return lane_result("grads_reference", tmp_path_factory)


# conftest.shared_2_ranks' grad_worker cases: each Config.fsdp ("+keep", "+replicate"; else reshard)
FSDP_CASES = [
    "split",
    "uneven",
    "uneven+ckpt",
    "split+replicate",
    "uneven+replicate",
    "uneven+keep",
]
FSDP_CASES += ["uneven+ckpt+keep"]


@pytest.fixture(scope="module")
def grads_by_case(grads_reference, shared_2_ranks):
    """case -> (reference, FSDP2) gradients: the 2-rank FSDP2 runs (split, uneven, uneven+ckpt) are
    tests/grad_worker.py's run of conftest.shared_2_ranks' launch."""
    from safetensors.torch import load_file

    out, result = shared_2_ranks
    result.log(SHARED_RUNS.index("grads"))
    return {
        c: (
            load_file(grads_reference / f"ref-{c.partition('+')[0]}.safetensors"),
            load_file(out / f"fsdp-{c}.safetensors"),
        )
        for c in FSDP_CASES
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", FSDP_CASES)
def test_two_ranks_with_different_modalities_match_reference(grads_by_case, case):
    """FSDP2 on 2 ranks. split: rank 0's micro-batch is image-only, rank 1's video-only. uneven: rank 0 has an
    image and a video (the tower runs twice), rank 1 text only (without the dummy rows: a collective
    mismatch). Each finishes and its gradient equals one process computing all the rows (+ckpt: the 2 ranks
    with activation checkpointing, the reference without; +keep, +replicate: train.Config.fsdp)."""
    ref, got = grads_by_case[case]
    assert ref.keys() == got.keys()
    assert any(
        k.startswith("model.visual.blocks") and ref[k].abs().sum() > 0 for k in ref
    )  # vision got gradient
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=k)


def test_offline_swap_slot_tokens_and_threshold(processor, synth):
    """The offline trajectory replaces the LAST rollout; its tokens are exactly the tokenized text + EOS (cut to
    max_response_len like a sampled completion, EOS first to go); threshold mode swaps only below threshold."""
    import train
    from rollout import Rollout

    tok = processor.tokenizer
    s = next(
        x
        for x in data.load_samples(os.path.join(synth, "train.jsonl"))
        if x["id"].startswith("color")
    )
    p = data.prepare(s, processor, tiny_config())
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    right, wrong = s["offline_output"], "<answer>Z</answer>"
    rollouts = [
        Rollout(p, tok.encode(t, add_special_tokens=False) + [eos], [-1.0] * 9, t)
        for t in (wrong, right, wrong, wrong)
    ]
    cfg = tiny_config(group_size=4, max_response_len=64)
    group = train.Group(rollouts, train.score(rollouts, cfg))
    g = train.swap_offline(group, cfg, tok, eos)
    assert (
        g.rollouts[:3] == rollouts[:3]
        and g.components[:3] == group.components[:3]
        and g is not group
    )
    assert (
        g.rollouts[3].finish == "offline"
        and g.rollouts[3].logp is None
        and g.rollouts[3].text == right
    )
    assert g.rollouts[3].response_ids == tok.encode(right, add_special_tokens=False) + [eos]
    assert (
        g.components[3]["accuracy"] == 1.0
        and g.components[3]["overall"] > group.components[3]["overall"]
    )
    assert group.rollouts[3].text == wrong  # the input group is untouched
    short = train.swap_offline(
        group, tiny_config(group_size=4, max_response_len=3), tok, eos
    ).rollouts[3]
    assert (
        short.response_ids == tok.encode(right, add_special_tokens=False)[:3]
    )  # truncated: no EOS
    # threshold mode: online accuracy here is 1/4
    assert (
        train.swap_offline(group, tiny_config(mix_threshold=0.5), tok, eos).rollouts[3].finish
        == "offline"
    )
    assert (
        train.swap_offline(group, tiny_config(mix_threshold=0.25), tok, eos) is group
    )  # 0.25 !< 0.25
    assert train.swap_offline(group, tiny_config(mix_offline=False), tok, eos) is group


@background("text_vs_video")
def text_vs_video_runs(tmp_path_factory):
    """Two 2-rank runs, HF generate then vLLM, in one torchrun launch (tests/train_worker.py; conftest's background
    lane): every step one rank holds a text-only prompt and the other a video prompt. Returns (video sample, rollout
    -> metrics rows)."""
    import json

    from train_worker import launch

    tmp_path = tmp_path_factory.mktemp("text_vs_video")
    video = next(
        s for s in data.load_samples(os.path.join(synth_dir(), "train.jsonl")) if s.get("videos")
    )
    text = {
        "id": "text-0",
        "problem": "What is two plus three?",
        "answer": "5",
        "problem_type": "numerical",
        "data_type": "text",
        "offline_output": "<answer>5</answer>",
    }
    shutil.copy(video["videos"][0], tmp_path)  # media inside the data's folder
    video = dict(video, videos=[os.path.basename(video["videos"][0])])
    (tmp_path / "d.jsonl").write_text(json.dumps(video) + "\n" + json.dumps(text) + "\n")
    rollouts, model = ("hf", "vllm"), tiny_model_dir()

    def run():
        launch(
            [
                [
                    "--config",
                    "configs/tiny_cpu.yaml",
                    "--model",
                    model,
                    "--train-data",
                    str(tmp_path / "d.jsonl"),
                    "--val-data",
                    "",
                    "--out-dir",
                    str(tmp_path / rollout),
                    "--max-steps",
                    "2",
                    "--group-size",
                    "2",
                    "--prompts-per-step",
                    "2",
                    "--rollout",
                    rollout,
                    "--no-save",
                    "--cache-dir",
                    "",
                    "--dist-timeout",
                    "120",
                ]
                for rollout in rollouts
            ]
        )
        return video, {
            r: [json.loads(x) for x in open(tmp_path / r / "metrics.jsonl")] for r in rollouts
        }

    return run


@pytest.fixture(scope="module")
def text_vs_video(tmp_path_factory) -> tuple:
    return lane_result("text_vs_video", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_two_ranks_text_vs_video_train(text_vs_video, rollout):
    """A real 2-rank run where, every step, one rank holds a text-only prompt and the other a video prompt: HF
    generate on the FSDP model and the trainer's forwards must both keep their collectives aligned."""
    import math

    video, runs = text_vs_video
    rows = runs[rollout]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(sorted(r["data/ids"]) == sorted([video["id"], "text-0"]) for r in rows)

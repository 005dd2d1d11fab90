"""scripts/make_tiny_model.py: the tiny checkpoints are deterministic, tokenize right, and run a video prompt in
transformers and in vLLM. The checkpoints land in the shared .cache/models (other tests reuse them).

    .venv/bin/python -m pytest -q tests/test_tiny_model.py
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, background, lane_result
from safetensors.torch import load_file

import make_tiny_model as mtm

CACHE = os.path.join(ROOT, ".cache/models")
FACTOR = {
    a: 2 * spec["patch"] for a, spec in mtm.ARCHS.items()
}  # pixels per merged visual token side: 28 / 32
# 4 frames of 2x2 merged tokens: the clips our synthetic data uses (56x56 for Qwen2/2.5-VL, 64x64 for Qwen3-VL)
META = dict(
    fps=2.0, duration=2.0, total_num_frames=4, frames_indices=[0, 1, 2, 3], video_backend="decord"
)
N_VIDEO_TOKENS = 8  # 2 temporal patches x (4x4 patches / 2x2 merge)


def frames(arch):
    f = FACTOR[arch]
    return np.random.default_rng(0).integers(
        0, 256, (4, 2 * f, 2 * f, 3), dtype=np.uint8
    )  # T, H, W, C


def read(d, name):
    with open(os.path.join(d, name)) as f:
        return f.read()


def video_prompt(processor_or_tokenizer):
    msgs = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "What color is it?"}],
        }
    ]
    return processor_or_tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def load(folder: str):
    """The checkpoint's model as the trainer loads it (Omni: the thinker, train.load_model's rule)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(folder)
    config = getattr(config, "thinker_config", config)
    return AutoModelForImageTextToText.from_pretrained(folder, config=config).eval()


@pytest.fixture(scope="module")
def ckpt():
    return {a: mtm.ensure(a, root=CACHE) for a in mtm.ARCHS}


def test_deterministic_idempotent(tmp_path):
    a, b, c = (
        mtm.build("qwen3_vl", str(tmp_path / n), seed=s) for n, s in (("a", 3), ("b", 3), ("c", 4))
    )
    wa, wb, wc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert all(w.dtype == torch.float32 for w in wa.values())
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    assert read(a, "tokenizer.json") == read(
        c, "tokenizer.json"
    )  # the seed leaves the tokenizer (token ids) alone
    stamp = os.path.getmtime(os.path.join(a, "model.safetensors"))
    assert (
        mtm.build("qwen3_vl", a, seed=3) == a
        and os.path.getmtime(os.path.join(a, "model.safetensors")) == stamp
    )
    mtm.build("qwen3_vl", a, seed=3, force=True)  # replaces it in place, leaves no temp dirs behind
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]
    assert json.loads(read(a, mtm.MARKER))["seed"] == 3


@pytest.mark.parametrize("arch", mtm.ARCHS)
def test_tokenizer_and_config(ckpt, arch):
    from transformers import AutoConfig, AutoTokenizer

    tok, cfg = AutoTokenizer.from_pretrained(ckpt[arch]), AutoConfig.from_pretrained(ckpt[arch])
    cfg = getattr(cfg, "thinker_config", cfg)  # Omni: the thinker's
    names = mtm.VL_TOKENS | mtm.ARCHS[arch].get("tokens", {})
    for t in mtm.SPECIAL[:3] + list(names.values()) + mtm.ADDED:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    for s in [
        '{"time": [1.5, 3.0]}',
        "A. red\nB. green\nC. blue\nD. yellow",
        "x = (3, 4)!  [12, 0.25]\t~@#$%^&*",
        "<think>the square moves left</think><answer>B</answer>",
    ]:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=True) == s
    video = names["vision_bos_token"] + names["video_token"] + names["vision_eos_token"]
    ids = tok.encode(f"<|im_start|>user\n{video}hi<|im_end|>", add_special_tokens=False)
    assert (
        tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    )  # the Qwen specials are special, ADDED are not
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert cfg.text_config.vocab_size == len(tok) and cfg.text_config.head_dim == 64
    for key, t in [
        ("image_token_id", "image_token"),
        ("video_token_id", "video_token"),
        ("vision_start_token_id", "vision_bos_token"),
        ("vision_end_token_id", "vision_eos_token"),
        ("audio_token_id", "audio_token"),
    ]:
        if t in names:
            assert getattr(cfg, key) == tok.convert_tokens_to_ids(names[t]), key


@pytest.mark.parametrize("arch", mtm.ARCHS)
def test_transformers_forward_with_video(ckpt, arch):
    from transformers import AutoProcessor

    proc, model = AutoProcessor.from_pretrained(ckpt[arch]), load(ckpt[arch])
    assert model.dtype == torch.float32
    # the Omni processor's own video size (128 tokens at least) overrides its video processor's: data.prepare and
    # vLLM's requests pass do_resize=False, the frames already sized (cache.py)
    kept = {"do_resize": False} if "omni" in arch else {}
    x = proc(
        text=[video_prompt(proc)],
        videos=[frames(arch)],
        video_metadata=[META],
        do_sample_frames=False,
        return_tensors="pt",
        **kept,
    )
    n_pad = int((x["input_ids"] == model.config.video_token_id).sum())
    assert x["video_grid_thw"].tolist() == [
        [2, 4, 4]
    ]  # not upscaled: the processor's pixel floor is 2x2 tokens
    assert n_pad == int(x["video_grid_thw"].prod()) // 4 == N_VIDEO_TOKENS
    with torch.no_grad():
        logits = model(**x).logits
    assert logits.shape[-1] == len(proc.tokenizer) and torch.isfinite(logits).all()


VLLM_SCRIPT = """
import json, sys
import numpy as np
from transformers import AutoProcessor
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    res = {}
    for arch, d, f in json.loads(sys.argv[1]):
        llm = LLM(model=d, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
        proc = AutoProcessor.from_pretrained(d)
        msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What color is it?"}]}]
        text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        frames = np.random.default_rng(0).integers(0, 256, (4, 2 * f, 2 * f, 3), dtype=np.uint8)
        meta = dict(fps=2.0, duration=2.0, total_num_frames=4, frames_indices=[0, 1, 2, 3], video_backend="decord")
        hf_ids = proc(text=[text], videos=[frames], video_metadata=[meta], do_sample_frames=False,
                      return_tensors="np")["input_ids"][0]
        video = (frames, dict(meta, do_sample_frames=False))  # vLLM refuses a video without metadata
        out = llm.generate([{"prompt": text, "multi_modal_data": {"video": video}}] * 2,
                           SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), use_tqdm=False)
        res[arch] = dict(n_out=[len(o.outputs[0].token_ids) for o in out],
                         same_prompt=list(out[0].prompt_token_ids) == hf_ids.tolist(),
                         vocab_ok=llm.llm_engine.model_config.get_vocab_size() == len(proc.tokenizer))
        del llm
    print("RESULT" + json.dumps(res))
"""


# the newer families' engines start in test_rollout's `family` fixture (one each, shared by their tests)
VLLM_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@background("vllm_video_results")
def vllm_video_process(tmp_path_factory):
    """Every arch in one fresh process (in conftest's background lane): vLLM's import (~14 s) is paid once, and
    pytest stays free of engines. Returns the process (its stdout and stderr)."""
    jobs = [(a, mtm.ensure(a, root=CACHE), FACTOR[a]) for a in VLLM_ARCHS]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")

    def run():
        return subprocess.run(
            [sys.executable, "-c", VLLM_SCRIPT, json.dumps(jobs)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    return run


@pytest.fixture(scope="module")
def vllm_video_results(tmp_path_factory):
    return lane_result("vllm_video_results", tmp_path_factory)


@pytest.mark.slow
def test_vllm_generates_from_video(vllm_video_results):
    p = vllm_video_results
    assert "RESULT" in p.stdout, p.stderr[-4000:]
    res = json.loads(p.stdout.split("RESULT")[1])
    for arch in VLLM_ARCHS:
        assert res[arch]["n_out"] == [8, 8] and res[arch]["vocab_ok"], (arch, res)
        assert res[arch]["same_prompt"], (
            f"{arch}: vLLM expanded the video differently from the HF processor"
        )


def vllm_positions(arch: str, config, tokens: list[int], items: list) -> torch.Tensor:
    """vLLM 0.32's M-RoPE positions (3, S) of one unpadded prompt, from its own function (no engine): items are
    (modality, offset of the first placeholder, grid_thw, second_per_grid_ts or None), in the shape vLLM stores them."""
    import types
    from vllm.model_executor.models import qwen2_5_vl, qwen2_vl, qwen3_vl

    feats = []
    for kind, offset, grid, seconds in items:
        data = {f"{kind}_grid_thw": types.SimpleNamespace(data=grid)}
        if seconds is not None:
            data["second_per_grid_ts"] = types.SimpleNamespace(data=seconds)
        # Qwen3-VL's video offset is before the first frame's <|vision_start|> (the frames are found from there)
        offset -= arch.startswith("qwen3") and kind == "video"
        feats.append(
            types.SimpleNamespace(
                modality=kind, mm_position=types.SimpleNamespace(offset=offset), data=data
            )
        )
    if arch.startswith("qwen3"):  # Qwen3-VL-MoE's and Qwen3.5's (dense, MoE) are Qwen3-VL's
        return qwen3_vl.Qwen3VLForConditionalGeneration._get_mrope_input_positions(
            tokens, feats, config
        )[0]
    cls = {
        "qwen2_vl": qwen2_vl.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
    }[arch]
    model = types.SimpleNamespace(config=config)  # all the method reads of the model
    model.iter_mm_grid_thw = types.MethodType(cls.iter_mm_grid_thw, model)
    return cls.get_mrope_input_positions(model, tokens, feats)[0]


@pytest.mark.slow  # imports vLLM's model code (no engine)
@pytest.mark.parametrize("arch", [a for a in mtm.ARCHS if "omni" not in a])
def test_mrope_positions_are_vllms(ckpt, arch):
    """sp.mrope_positions (the trainer's and the HF engine's) equals vLLM's M-RoPE positions on a left-padded batch:
    a 3:2 video of 8 frames (4 frame pairs: time runs past rows and columns), and an image + a 4-frame video, at a time
    scale that floors (Qwen2.5-VL: tokens_per_second x 0.7 s per frame pair). transformers 5.19's own positions
    differ after the long video for Qwen2-VL and Qwen2.5-VL (it resumes the text at max(rows, columns)), not for
    Qwen3-VL (a frame pair per timestamp): when they agree, upstream is fixed and sp.mrope_positions can go."""
    import sp
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc, model = (
        AutoProcessor.from_pretrained(ckpt[arch]),
        AutoModelForImageTextToText.from_pretrained(ckpt[arch]),
    )
    f, rng = FACTOR[arch], np.random.default_rng(1)
    long = rng.integers(0, 256, (8, 2 * f, 3 * f, 3), dtype=np.uint8)
    meta = dict(META, duration=4.0, total_num_frames=8, frames_indices=list(range(8)))
    rows = [
        ([{"type": "video"}], dict(videos=[long], video_metadata=[meta])),
        (
            [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "And now?"}],
            dict(
                images=[rng.integers(0, 256, (f, 2 * f, 3), dtype=np.uint8)],
                videos=[frames(arch)],
                video_metadata=[META],
            ),
        ),
    ]
    xs = []
    for content, media in rows:
        msgs = [
            {"role": "user", "content": content + [{"type": "text", "text": "What color is it?"}]}
        ]
        text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        xs.append(proc(text=[text], do_sample_frames=False, return_tensors="pt", **media))
    S = max(x["input_ids"].shape[1] for x in xs)
    ids = torch.stack(
        [F.pad(x["input_ids"][0], (S - x["input_ids"].shape[1], 0)) for x in xs]
    )  # left padding
    mask = torch.stack(
        [
            F.pad(
                torch.ones(x["input_ids"].shape[1], dtype=torch.long),
                (S - len(x["input_ids"][0]), 0),
            )
            for x in xs
        ]
    )
    grids = {
        k: torch.cat([x[k] for x in xs if k in x])
        for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
        if any(k in x for x in xs)
    }
    if "second_per_grid_ts" in grids:
        grids["second_per_grid_ts"] = torch.full_like(grids["second_per_grid_ts"], 0.7)
    ours = sp.mrope_positions(ids, mask, grids, model.config)  # (3, B, S)
    assert (ours[:, mask == 0] == 0).all()
    videos, seconds = (
        iter(grids["video_grid_thw"]),
        iter(grids.get("second_per_grid_ts", [None] * 2)),
    )
    for b, x in enumerate(xs):
        tokens, items = x["input_ids"][0].tolist(), []
        for kind in ("image", "video"):
            pad = getattr(model.config, f"{kind}_token_id")
            grid = x.get(f"{kind}_grid_thw")
            if grid is not None:
                items.append(
                    (
                        kind,
                        tokens.index(pad),
                        next(videos) if kind == "video" else grid[0],
                        next(seconds) if kind == "video" else None,
                    )
                )
        want = vllm_positions(arch, model.config, tokens, items)  # (3, S_b)
        assert torch.equal(ours[:, b, mask[b].bool()], want), (arch, b)
    mm = dict(
        mm_token_type_ids=(ids == model.config.image_token_id).int()
        + 2 * (ids == model.config.video_token_id),
        attention_mask=mask,
        **grids,
    )
    upstream, _ = model.model.get_rope_index(ids, **mm)
    # the long video's row: the same vision positions, the text after it elsewhere (but Qwen3-VL's)
    assert torch.equal(upstream[:, 0], ours[:, 0]) == arch.startswith("qwen3"), (
        "transformers changed: see the docstring"
    )


def omni_features(config, ids: list[int], x: dict) -> list:
    """A prompt's video-with-soundtrack as vLLM 0.32 holds it (MultiModalFeatureSpec's fields): the video's
    placeholder starts at its <|audio_bos|> (the replacement's first token), the soundtrack is an audio item."""
    import types

    def feature(kind, offset, **data):
        fields = {k: types.SimpleNamespace(data=torch.as_tensor(v)) for k, v in data.items()}
        pos = types.SimpleNamespace(offset=offset)
        return types.SimpleNamespace(modality=kind, mm_position=pos, data=fields)

    start = ids.index(config.video_token_id) - 1
    return [
        feature(
            "video",
            start,
            video_grid_thw=x["video_grid_thw"][0],
            second_per_grid_ts=x["video_second_per_grid"][0],
            use_audio_in_video=True,
        ),
        feature("audio", start, audio_feature_lengths=x["feature_attention_mask"][0].sum()),
    ]


@pytest.mark.slow  # imports vLLM's model code (no engine)
@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_omni_positions_are_vllms(ckpt, arch):
    """The Omni thinkers' TMRoPE (sp.mrope_positions) equals vLLM 0.32's positions (its own function, no engine) on
    a left-padded batch of two videos with their soundtracks: a soundtrack longer than the frames (5.3 s of sound, 8
    frames over 2.8 s) and one shorter (1 s), at a time scale that floors (0.7 s per frame pair). Qwen2.5-Omni
    interleaves in 2 s chunks and vLLM lays each block from the <|audio_bos|> before it, one token early; Qwen3-Omni
    interleaves token by token, and vLLM lays the positions in the order of the floored frame times (9.1 -> 9: a
    frame's position before the 9th audio token's, on the 9th audio token). transformers' get_rope_index differs
    (LOG.md, session 11): the sampler is the reference."""
    import importlib

    import sp
    from transformers import AutoProcessor

    module, name = {
        "qwen2_5_omni": ("qwen2_5_omni_thinker", "Qwen2_5OmniThinkerForConditionalGeneration"),
        "qwen3_omni_moe": ("qwen3_omni_moe_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration"),
    }[arch]
    VLLMThinker = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    folder = ckpt[arch]
    proc, config = AutoProcessor.from_pretrained(folder), load(folder).config
    rng = np.random.default_rng(1)
    video = rng.integers(0, 256, (8, 56, 84, 3), dtype=np.uint8)
    meta = dict(META, duration=4.0, total_num_frames=8, frames_indices=list(range(8)))
    xs = []
    for seconds in (5.3, 1.0):
        sound = np.sin(np.arange(int(16000 * seconds)) * 0.1).astype(np.float32)
        xs.append(
            proc(
                text=[video_prompt(proc)],
                videos=[video],
                video_metadata=[meta],
                audio=[sound],
                use_audio_in_video=True,
                fps=2 / 0.7,
                do_sample_frames=False,
                return_tensors="pt",
            )
        )
    S = max(x["input_ids"].shape[1] for x in xs)
    ids = torch.stack([F.pad(x["input_ids"][0], (S - x["input_ids"].shape[1], 0)) for x in xs])
    mask = (torch.arange(S) >= torch.tensor([[S - x["input_ids"].shape[1]] for x in xs])).long()
    grids = dict(
        video_grid_thw=torch.cat([x["video_grid_thw"] for x in xs]),
        second_per_grid_ts=torch.cat([x["video_second_per_grid"] for x in xs]),
    )
    ours = sp.mrope_positions(ids, mask, grids, config)  # (3, B, S)
    vllm = object.__new__(VLLMThinker)  # all its position code reads of the model: the config
    vllm.config = config
    for b, x in enumerate(xs):
        tokens = x["input_ids"][0].tolist()
        assert tokens.count(config.audio_token_id) > 0
        want, _ = vllm.get_mrope_input_positions(tokens, omni_features(config, tokens, x))
        assert torch.equal(ours[:, b, mask[b].bool()], want), b

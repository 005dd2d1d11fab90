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
from conftest import ROOT, background, lane_result
from safetensors.torch import load_file

import make_tiny_model as mtm

CACHE = os.path.join(ROOT, ".cache/models")
FACTOR = {a: 2 * spec["patch"] for a, spec in mtm.ARCHS.items()}  # pixels per merged visual token side: 28 / 32
# 4 frames of 2x2 merged tokens: the clips our synthetic data uses (56x56 for Qwen2/2.5-VL, 64x64 for Qwen3-VL)
META = dict(fps=2.0, duration=2.0, total_num_frames=4, frames_indices=[0, 1, 2, 3], video_backend="decord")
N_VIDEO_TOKENS = 8  # 2 temporal patches x (4x4 patches / 2x2 merge)


def frames(arch):
    f = FACTOR[arch]
    return np.random.default_rng(0).integers(0, 256, (4, 2 * f, 2 * f, 3), dtype=np.uint8)  # T, H, W, C


def read(d, name):
    with open(os.path.join(d, name)) as f:
        return f.read()


def video_prompt(processor_or_tokenizer):
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What color is it?"}]}]
    return processor_or_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def ckpt():
    return {a: mtm.ensure(a, root=CACHE) for a in mtm.ARCHS}


def test_deterministic_idempotent(tmp_path):
    a, b, c = (mtm.build("qwen3_vl", str(tmp_path / n), seed=s) for n, s in (("a", 3), ("b", 3), ("c", 4)))
    wa, wb, wc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert all(w.dtype == torch.float32 for w in wa.values())
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    assert read(a, "tokenizer.json") == read(c, "tokenizer.json")  # the seed leaves the tokenizer (token ids) alone
    stamp = os.path.getmtime(os.path.join(a, "model.safetensors"))
    assert mtm.build("qwen3_vl", a, seed=3) == a and os.path.getmtime(os.path.join(a, "model.safetensors")) == stamp
    mtm.build("qwen3_vl", a, seed=3, force=True)  # replaces it in place, leaves no temp dirs behind
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]
    assert json.loads(read(a, mtm.MARKER))["seed"] == 3


@pytest.mark.parametrize("arch", mtm.ARCHS)
def test_tokenizer_and_config(ckpt, arch):
    from transformers import AutoConfig, AutoTokenizer
    tok, cfg = AutoTokenizer.from_pretrained(ckpt[arch]), AutoConfig.from_pretrained(ckpt[arch])
    for t in mtm.SPECIAL + mtm.ADDED:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    for s in ['{"time": [1.5, 3.0]}', "A. red\nB. green\nC. blue\nD. yellow", "x = (3, 4)!  [12, 0.25]\t~@#$%^&*",
              "<think>the square moves left</think><answer>B</answer>"]:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=True) == s
    ids = tok.encode("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>hi<|im_end|>",
                     add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"  # the Qwen specials are special, ADDED are not
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert cfg.text_config.vocab_size == len(tok) and cfg.text_config.head_dim == 64
    for key, t in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                   ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]:
        assert getattr(cfg, key) == tok.convert_tokens_to_ids(t), key


@pytest.mark.parametrize("arch", mtm.ARCHS)
def test_transformers_forward_with_video(ckpt, arch):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    proc, model = AutoProcessor.from_pretrained(ckpt[arch]), AutoModelForImageTextToText.from_pretrained(ckpt[arch])
    assert model.dtype == torch.float32
    x = proc(text=[video_prompt(proc)], videos=[frames(arch)], video_metadata=[META], do_sample_frames=False,
             return_tensors="pt")
    n_pad = int((x["input_ids"] == model.config.video_token_id).sum())
    assert x["video_grid_thw"].tolist() == [[2, 4, 4]]  # not upscaled: the processor's pixel floor is 2x2 tokens
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


@background("vllm_video_results")
def vllm_video_process(tmp_path_factory):
    """Every arch in one fresh process (in conftest's background lane): vLLM's import (~14 s) is paid once, and
    pytest stays free of engines. Returns the process (its stdout and stderr)."""
    jobs = [(a, mtm.ensure(a, root=CACHE), FACTOR[a]) for a in mtm.ARCHS]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")

    def run():
        return subprocess.run([sys.executable, "-c", VLLM_SCRIPT, json.dumps(jobs)], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
    return run


@pytest.fixture(scope="module")
def vllm_video_results(tmp_path_factory):
    return lane_result("vllm_video_results", tmp_path_factory)


@pytest.mark.slow
def test_vllm_generates_from_video(vllm_video_results):
    p = vllm_video_results
    assert "RESULT" in p.stdout, p.stderr[-4000:]
    res = json.loads(p.stdout.split("RESULT")[1])
    for arch in mtm.ARCHS:
        assert res[arch]["n_out"] == [8, 8] and res[arch]["vocab_ok"], (arch, res)
        assert res[arch]["same_prompt"], f"{arch}: vLLM expanded the video differently from the HF processor"


@pytest.mark.xfail(strict=True, reason="transformers 5.19's get_rope_index resumes the text after a video at max(h, w) "
                   "merged tokens, not after the video's last temporal position as vLLM and the original Qwen code do "
                   "(LOG.md, 2026-11-26 Qwen2-VL): fixed upstream when this passes")
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_upstream_text_after_a_long_video_follows_its_last_frame_pair(ckpt, arch):
    """8 frames = 4 frame pairs of 2x2 merged tokens: the temporal positions run past the spatial ones, and the first
    text token after the video must come after all of them (where vLLM puts it: the sampler and the trainer differ
    by up to 2e-3 per token on the tiny models until then; more on trained ones)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    proc, model = AutoProcessor.from_pretrained(ckpt[arch]), AutoModelForImageTextToText.from_pretrained(ckpt[arch])
    meta = dict(META, duration=4.0, total_num_frames=8, frames_indices=list(range(8)))
    x = proc(text=[video_prompt(proc)], videos=[np.concatenate([frames(arch)] * 2)], video_metadata=[meta],
             do_sample_frames=False, return_tensors="pt")
    grids = {k: x[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in x}
    pos, _ = model.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], **grids)
    video = (x["input_ids"][0] == model.config.video_token_id).nonzero()[:, 0]
    assert len(video) == 16 and pos[0, 0, video].max() > pos[1:, 0, video].max()  # time runs past the rows/columns
    assert pos[:, 0, video[-1] + 1].tolist() == [pos[:, 0, video].max().item() + 1] * 3

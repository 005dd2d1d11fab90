"""scripts/make_tiny_model.py: both tiny checkpoints load in transformers and in vLLM, deterministically.

    .venv/bin/python -m pytest -q tests/test_tiny_model.py
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file

import make_tiny_model

ARCHS = {"qwen2_5_vl": 28, "qwen3_vl": 32}  # patch 14 / 16, times merge 2


def test_deterministic_by_seed(tmp_path):
    a = make_tiny_model.build("qwen2_5_vl", str(tmp_path / "a"), seed=3)
    b = make_tiny_model.build("qwen2_5_vl", str(tmp_path / "b"), seed=3)
    c = make_tiny_model.build("qwen2_5_vl", str(tmp_path / "c"), seed=4)
    wa, wb, wc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_forward_with_video(arch):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    d = make_tiny_model.ensure(arch, root=os.path.join(ROOT, ".cache/models"))
    proc = AutoProcessor.from_pretrained(d)
    tok = proc.tokenizer
    for t in make_tiny_model.SPECIAL + make_tiny_model.ADDED:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    s = 'A. red {"time": [1.5, 3.0]} <think>x</think><answer>B</answer>'
    assert tok.decode(tok.encode(s, add_special_tokens=False), skip_special_tokens=True) == s
    f = ARCHS[arch]
    frames = torch.from_numpy(np.random.default_rng(0).integers(0, 255, (4, 2 * f, 2 * f, 3), dtype=np.uint8)).permute(0, 3, 1, 2)
    meta = dict(fps=2.0, duration=2.0, total_num_frames=4, frames_indices=[0, 1, 2, 3], video_backend="decord")
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}],
                                    tokenize=False, add_generation_prompt=True)
    x = proc(text=[text], videos=[frames], video_metadata=[meta], do_resize=False, do_sample_frames=False, return_tensors="pt")
    n_pad = int((x["input_ids"] == tok.convert_tokens_to_ids("<|video_pad|>")).sum())
    assert n_pad == int(x["video_grid_thw"].prod()) // 4 == 8  # 2 temporal patches x (4x4 patches / merge 2x2)
    model = AutoModelForImageTextToText.from_pretrained(d)
    assert model.config.text_config.head_dim == 64  # vLLM's CPU attention rejects smaller heads
    assert torch.isfinite(model(**x).logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_generates_from_video(arch):
    """vLLM in a fresh process (one engine per process keeps the tests independent)."""
    d = make_tiny_model.ensure(arch, root=os.path.join(ROOT, ".cache/models"))
    f = ARCHS[arch]
    code = f"""
import numpy as np
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model={d!r}, dtype="float32", enforce_eager=True, max_model_len=1024)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{{"role": "user", "content": [{{"type": "video"}}, {{"type": "text", "text": "hi"}}]}}],
                                   tokenize=False, add_generation_prompt=True)
    frames = np.random.default_rng(0).integers(0, 255, (4, {2 * f}, {2 * f}, 3), dtype=np.uint8)
    meta = dict(fps=2.0, duration=2.0, total_num_frames=4, frames_indices=[0, 1, 2, 3], video_backend="decord",
                do_sample_frames=False)
    out = llm.generate({{"prompt": text, "multi_modal_data": {{"video": (frames, meta)}}}},
                       SamplingParams(max_tokens=8, temperature=1.0, seed=0), use_tqdm=False)
    print("NTOK", len(out[0].outputs[0].token_ids))
"""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "NTOK" in p.stdout, p.stderr[-3000:]
    assert int(p.stdout.split("NTOK")[1].split()[0]) > 0

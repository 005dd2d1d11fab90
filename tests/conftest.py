"""Shared fixtures: the tiny checkpoints and a small synthetic data set, built on demand into .cache/.

    .venv/bin/python -m pytest -q tests
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
# vLLM on this CPU: a small KV cache, and the engine in-process so tests can reach the model
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every model here is a local folder: a hub id (the shipped 7B configs' heads check) fails at once instead of
# waiting on retries where there is no network (test_check_config: 25.7 -> 2.1 s); export 0 to go online
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model():
    import make_tiny_model
    return make_tiny_model.ensure("qwen2_5_vl", root=os.path.join(ROOT, ".cache/models"))


@pytest.fixture(scope="session")
def synth():
    """All synthetic tasks, a few samples each: {task}-prefixed ids in train.jsonl / val.jsonl."""
    import make_synthetic_data
    out = os.path.join(ROOT, ".cache/data/test_mixed")
    make_synthetic_data.make(out, ["color", "direction", "count", "appear", "image_color"], num_train=8, num_val=4,
                             seed=0, size=56, fps=4, seconds=2.0)
    return out


def tiny_config(**kw):
    """train.Config for the tiny model and 56x56 synthetic videos (what configs/tiny_cpu.yaml uses)."""
    from train import Config
    base = dict(model=os.path.join(ROOT, ".cache/models/tiny-qwen2_5_vl"), video_fps=4.0, video_min_frames=4,
                video_max_frames=8, video_min_pixels=3136, video_max_pixels=3136, image_min_pixels=3136,
                image_max_pixels=3136, max_prompt_len=1024, max_model_len=1024, cache_dir="",
                video_source="decode_only")
    base.update(kw)
    return Config(**base)


def vllm_greedy_tokens(model_dir: str) -> int:
    """How many tokens vLLM generates greedily (at most 4) from an exported HF folder, in a fresh process: the folder
    loads in vLLM as written."""
    import subprocess
    code = ("from vllm import LLM, SamplingParams\n"
            f"llm = LLM(model={model_dir!r}, dtype='float32', enforce_eager=True, max_model_len=512)\n"
            "out = llm.generate(['<|im_start|>user\\nhello<|im_end|>\\n'],\n"
            "                   SamplingParams(max_tokens=4, temperature=0))\n"
            "print('TOKENS', len(out[0].outputs[0].token_ids))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "TOKENS " in p.stdout, p.stderr[-3000:]
    return int(p.stdout.split("TOKENS ")[1])

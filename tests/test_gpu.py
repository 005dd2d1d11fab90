"""CUDA-only paths: bf16 mixed precision under FSDP2 + nccl, flash-attn selection, vLLM sleep/wake, a real
train run on the GPU. Every test here skips without CUDA (CI and the dev machines have none).

    .venv/bin/python -m pytest -q tests/test_gpu.py
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tiny_config, tiny_model_dir

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.slow,
]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_VIDEO = all(
    importlib.util.find_spec(name) for name in ("av", "decord")
)  # writes / decodes the synthetic clips


@pytest.fixture
def one_rank_nccl(monkeypatch):
    """A world of one on the GPU, so FSDP2 and its mixed-precision policy are really applied."""
    import torch.distributed as dist

    for k, v in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533"
    ).items():
        monkeypatch.setenv(k, v)
    import train

    yield train.init_dist()
    dist.destroy_process_group()


def test_fsdp_bf16_compute_fp32_master(tiny_model, one_rank_nccl):
    """Params are all-gathered in bf16 for compute, the sharded master weights and their grads stay fp32."""
    import train

    _, _, device = one_rank_nccl
    assert device.type == "cuda"
    model = train.load_model(tiny_config(model=tiny_model), device)
    seen = {}
    layer = model.model.language_model.layers[0]
    # a pre-hook registered after fully_shard runs after FSDP's own pre-forward (the all-gather) and sees
    # the unsharded compute params; hooks return None (a returned value would replace inputs/outputs)
    layer.register_forward_pre_hook(lambda m, a: seen.update(w=m.mlp.up_proj.weight.dtype))
    layer.register_forward_hook(
        lambda m, a, out: seen.update(out=(out[0] if isinstance(out, tuple) else out).dtype)
    )
    ids = torch.randint(10, 200, (2, 16), device=device)
    out = model(
        input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=torch.zeros_like(ids)
    )
    assert (
        seen["w"] == torch.bfloat16 and seen["out"] == torch.bfloat16
    )  # all-gathered and computed in bf16
    out.logits.float().mean().backward()
    p = layer.mlp.up_proj.weight
    assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
    assert torch.isfinite(p.grad.full_tensor()).all()


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed"
)
def test_flash_attention_selected(tiny_model):
    import train

    model = train.load_model(tiny_config(model=tiny_model), torch.device("cuda"))
    assert model.config._attn_implementation == "flash_attention_2"


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM (CUDA build) not installed")
def test_vllm_sleep_frees_memory_and_wakes(tiny_model):
    """Sleep level 1 drops the KV cache and offloads weights: device memory comes back; after wake_up
    greedy outputs are unchanged."""
    from transformers import AutoTokenizer
    from rollout import VLLMEngine
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = VLLMEngine(tiny_model, tok, max_model_len=1024, gpu_memory_utilization=0.3, sleep=True)
    assert engine.can_sleep
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    before = (
        engine.llm.generate(["<|im_start|>user\nhello<|im_end|>\n"], sp)[0].outputs[0].token_ids
    )
    free0 = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free1 = torch.cuda.mem_get_info()[0]
    assert free1 - free0 > 1 << 30  # at least the KV cache (GiBs at 0.3 utilization) was released
    engine.wake()
    after = engine.llm.generate(["<|im_start|>user\nhello<|im_end|>\n"], sp)[0].outputs[0].token_ids
    assert list(before) == list(after)


@pytest.mark.skipif(not HAS_VIDEO, reason="av and decord not installed (synthetic videos)")
@pytest.mark.parametrize(
    "arch, task, run",
    [
        ("qwen2_5_vl", "color", ["--group-size", "4"]),
        ("qwen2_5_vl", "color", ["--group-size", "4", "--fsdp", "keep"]),  # blocks kept fwd -> bwd
        ("qwen2_5_vl", "color", ["--group-size", "1", "--loss-type", "sft", "--fsdp", "replicate"]),
        (
            "qwen3_5",
            "color",
            ["--group-size", "4"],
        ),  # gated delta-net + full attention layers, bf16
        ("qwen2_5_omni", "tone", ["--group-size", "4", "--video-audio"]),  # the soundtrack, bf16
    ],
    ids=["grpo", "keep", "sft_replicate", "qwen3_5", "omni"],
)
def test_train_two_steps_on_gpu(tmp_path, arch, task, run):
    """The real loop on the GPU: torchrun (nccl), FSDP2 bf16 (fsdp replicate: fp32, no FSDP2), vLLM rollout when
    installed, else HF generate; GRPO and the SFT cold start; Qwen2.5-VL, Qwen3.5 and Qwen2.5-Omni (audio-visual)."""
    import make_synthetic_data

    data = os.path.join(ROOT, f".cache/data/test_{task}")
    make_synthetic_data.make(
        data, [task], num_train=16, num_val=4, seed=1, size=56, fps=4, seconds=2.0
    )
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "train.py",
        "--config",
        "configs/tiny_cpu.yaml",
        "--model",
        tiny_model_dir(arch),
        "--train-data",
        f"{data}/train.jsonl",
        "--val-data",
        f"{data}/val.jsonl",
        "--out-dir",
        str(out),
        "--max-steps",
        "2",
        *run,
        "--prompts-per-step",
        "4",
        "--cache-dir",
        str(tmp_path / "frames"),
        "--rollout",
        "vllm" if HAS_VLLM else "hf",
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    # bf16 compute vs the sampler: agreement to bf16 precision, not fp32's 1e-3
    assert rows[0]["mismatch/mean"] < 0.1
    assert (out / "final" / "config.json").exists()


def test_offload_keeps_shards_and_optimizer_on_cpu(tiny_model, monkeypatch):
    """offload: the FSDP2 shards, their gradients and AdamW's state live in CPU memory; a step still trains, and the
    full tensors that engine.sync streams to vLLM can be gathered (the gloo backend beside nccl)."""
    import torch.distributed as dist
    from transformers import AutoProcessor

    import data
    import train
    from rollout import Rollout, vision_token_ids

    for k, v in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534"
    ).items():
        monkeypatch.setenv(k, v)
    _, _, device = train.init_dist(offload=True)
    try:
        tok = AutoProcessor.from_pretrained(tiny_model).tokenizer
        model = train.load_model(tiny_config(model=tiny_model, offload=True), device)
        p = model.model.language_model.layers[0].mlp.up_proj.weight
        assert p.to_local().device.type == "cpu"
        before = p.full_tensor().clone()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = [Rollout(data.Prompt({}, "", list(range(10, 30))), [40, 41, 42], None, "")]
        b = train.collate(rows, tok.pad_token_id, device)
        logp, _ = train.token_logp(model, b, 1.0, vision_token_ids(tok), chunk=2)
        (-(logp * b.mask).sum()).backward()
        assert p.grad.to_local().device.type == "cpu" and torch.isfinite(p.grad.full_tensor()).all()
        opt.step()
        assert opt.state[p]["exp_avg"].to_local().device.type == "cpu"
        assert not torch.equal(p.full_tensor(), before)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kernel", ["sdpa", "flash_attention_2"])
def test_sequence_parallel_on_two_gpus(tmp_path, synth, kernel):
    """sp 2 on 2 GPUs (nccl, FSDP2 bf16 compute) with each decoder kernel vs the same 2 ranks without SP, both
    checkpoints: log-probs, entropy and every gradient agree to bf16 precision, on padded micro-batches (the kernel's
    mask: sdpa's (B, 1, S, S), flash-attn's unpadding) and on unpadded ones (causal mode, no mask)."""
    from safetensors.torch import load_file
    from test_sp import BATCHES

    if kernel == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn not installed")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "tests/test_sp.py",
        str(tmp_path),
        os.path.join(synth, "train.jsonl"),
        "2",
        f"cuda-{kernel}",
        "qwen2_5_vl",
        "qwen3_vl",
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    for arch in ("qwen2_5_vl", "qwen3_vl"):
        got = load_file(tmp_path / f"{arch}.rank0.safetensors")
        for k in range(len(BATCHES)):
            for key in (f"logp{k}", f"ent{k}"):
                torch.testing.assert_close(
                    got[key], got[f"plain.{key}"], rtol=0, atol=5e-2, msg=f"{arch} {key}"
                )
        grads = [n for n in got if n.startswith("grad.")]
        assert grads and any(
            got[n].abs().sum() > 0 for n in grads if n.startswith("grad.model.visual.blocks")
        )
        for n in grads:
            g = got[f"plain.{n}"].float()
            torch.testing.assert_close(
                got[n].float(), g, rtol=5e-2, atol=5e-2 * g.abs().max().item(), msg=n
            )

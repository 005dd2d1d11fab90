"""LoRA (peft) on the real tiny Qwen2.5-VL: adapter sizes, the free reference policy, merged weights, and
2-rank torchrun runs with colocated vLLM (sampler/trainer agreement, exact resume, export).

    .venv/bin/python -m pytest -q tests/test_lora.py
"""

import json
import os
from dataclasses import dataclass

import pytest
import torch
from conftest import (
    ROOT,
    Runs,
    Share,
    share_of,
    synth_dir,
    tiny_config,
    tiny_model_dir,
    reference_logp,
    two_rank_share,
    vllm_greedy_tokens,
)
from safetensors.torch import load_file

import data
import train
from ckpt import hf_weights
from rollout import Rollout, vision_token_ids

LM = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
WITH_VISION = LM + r"|.*visual.blocks.*(qkv|proj)|.*merger.mlp.[02]"


@pytest.fixture(scope="module")
def batch(tiny_model, synth):
    """A micro-batch of 4 video prompts with fixed 5-token responses."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    samples = [s for s in data.load_samples(f"{synth}/train.jsonl") if s.get("videos")][:4]
    prompts = [data.prepare(s, proc, tiny_config()) for s in samples]
    ids = proc.tokenizer.encode("<answer>B</answer>", add_special_tokens=False)[:5]
    rollouts = [Rollout(p, ids, None, "") for p in prompts]
    return proc, train.collate(rollouts, proc.tokenizer.pad_token_id, "cpu")


def lora_model(tiny_model, rank=4, targets=LM, seed=0):
    """The trainer's LoRA model (train.load_model, one process: no FSDP) with random, nonzero B."""
    torch.manual_seed(seed)
    model = train.load_model(
        tiny_config(model=tiny_model, lora_rank=rank, lora_alpha=8.0, lora_targets=targets),
        torch.device("cpu"),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_reference_is_the_base_model_with_adapters_disabled(tiny_model, batch):
    proc, b = batch
    banned = vision_token_ids(proc.tokenizer)
    base = train.load_model(tiny_config(model=tiny_model), torch.device("cpu"))
    model = lora_model(tiny_model)
    with torch.no_grad():
        want = train.token_logp(base, b, 1.0, banned)[0]
        ref = reference_logp(model, None, b, 1.0, banned)
        policy = train.token_logp(model, b, 1.0, banned)[0]
    # adapters scaled to 0: the base model up to fp32 round-off (4.8e-7 here; B A x * 0 is added, other kernels)
    assert ((ref - want).abs() * b.mask).max() < 1e-5
    assert ((policy - want).abs() * b.mask).max() > 1e-3  # and on: B != 0 changes the policy


def test_optimizer_state_is_proportional_to_adapter_size(tiny_model, batch):
    """Only the adapters train: r * (in + out) per adapted linear layer, and AdamW keeps 2 floats per trainable one."""
    proc, b = batch
    r, h, inter, kv = (
        4,
        128,
        256,
        64,
    )  # the tiny model: hidden 128, MLP 256, 1 KV head of 64, 2 layers
    per_layer = r * (
        (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h)
    )  # q, k v, o, gate up, down
    model = lora_model(tiny_model, rank=r)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == 2 * per_layer == 16384
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    train.token_logp(model, b, 1.0, vision_token_ids(proc.tokenizer))[0].sum().backward()
    opt.step()
    state = sum(t.numel() for s in opt.state.values() for k, t in s.items() if k != "step")
    assert (
        state == 2 * 16384
    )  # exp_avg + exp_avg_sq: 32768 floats, against 2 x 669,120 for full fine-tuning


def test_merged_weights_equal_peft_merge(tiny_model):
    """The sync's merged tensors, under the base model's names, equal peft's own merge_and_unload."""
    from transformers import AutoModelForImageTextToText

    model = lora_model(tiny_model, targets=WITH_VISION)
    base = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    merged = {k: v.clone() for k, v in hf_weights(model)}
    want = model.merge_and_unload().state_dict()
    assert list(merged) == list(base) == list(want)
    assert all(torch.allclose(merged[k], want[k], atol=1e-6) for k in want)
    qkv = "model.visual.blocks.0.attn.qkv.weight"
    assert not torch.equal(merged[qkv], base[qkv])
    # a base weight is never merged with another layer's adapter nor dropped: an adapter missing its B is an error
    broken = lora_model(tiny_model)
    del broken.get_submodule(
        "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    ).lora_B["default"]
    with pytest.raises(
        ValueError, match=r"k_proj.lora_B.default.weight does not follow its base weight"
    ):
        list(hf_weights(broken))


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe"])
def test_reference_and_merge_on_the_other_families(arch, synth):
    """The two checks above on Qwen2-VL and Qwen3-VL, whose towers name their modules differently (Qwen2-VL: MLP
    fc1/fc2 and LayerNorms; Qwen3-VL: merger linear_fc1/2), and the MoE families (Qwen3.5-MoE: linear attention
    too): adapters scaled to 0 give the base model's log-probs, and the merged weights, the vision blocks' attention
    included, equal peft's merge. The default targets leave the routed experts (fused tensors, no Linear) and the
    linear-attention layers without adapters; Qwen3.5-MoE's shared expert gets them (docs/families.md)."""
    import make_tiny_model
    from transformers import AutoProcessor

    d = make_tiny_model.ensure(arch, root=os.path.join(ROOT, ".cache/models"))
    proc = AutoProcessor.from_pretrained(d)
    samples = [s for s in data.load_samples(f"{synth}/train.jsonl") if s.get("videos")][:2]
    ids = proc.tokenizer.encode("<answer>B</answer>", add_special_tokens=False)[:5]
    rows = [Rollout(data.prepare(s, proc, tiny_config(model=d)), ids, None, "") for s in samples]
    b = train.collate(rows, proc.tokenizer.pad_token_id, "cpu")
    banned = vision_token_ids(proc.tokenizer)
    base = train.load_model(tiny_config(model=d), torch.device("cpu"))
    model = lora_model(d, targets=WITH_VISION)
    with torch.no_grad():
        want = train.token_logp(base, b, 1.0, banned)[0]
        ref = reference_logp(model, None, b, 1.0, banned)
        policy = train.token_logp(model, b, 1.0, banned)[0]
    assert ((ref - want).abs() * b.mask).max() < 1e-5 and (
        (policy - want).abs() * b.mask
    ).max() > 1e-3
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert adapted and not any(".experts" in n or "linear_attn" in n for n in adapted)
    assert any(".shared_expert." in n for n in adapted) == (arch == "qwen3_5_moe")
    merged, before = dict(hf_weights(model)), base.state_dict()
    after = model.merge_and_unload().state_dict()
    assert list(merged) == list(before) == list(after)
    assert all(torch.allclose(merged[k], after[k], atol=1e-6) for k in after)
    qkv = "model.visual.blocks.0.attn.qkv.weight"
    assert not torch.equal(merged[qkv], before[qkv])


# ---------------------------------------------------------------------------------------------------
# 2 ranks under torchrun, colocated vLLM, LoRA on the language model and the vision tower, KL to the reference


def run_args(tiny_model, data_dir, out, *extra) -> list[str]:
    """train.py's arguments for a 2-rank LoRA run into `out`."""
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        "configs/lora.yaml",
        "--model",
        tiny_model,
        "--train-data",
        f"{data_dir}/train.jsonl",
        "--val-data",
        "",
        "--out-dir",
        str(out),
        "--group-size",
        "4",
        "--prompts-per-step",
        "4",
        "--cache-dir",
        str(out.parent / "frames"),
        "--lora-targets",
        WITH_VISION,
        "--kl-coef",
        "0.01",
        "--save-every",
        "2",
        "--keep-last",
        "0",
        *extra,
    ]


@two_rank_share
def lora_runs(tmp_path_factory) -> Share:
    """Two runs in conftest's shared 2-rank launch: "lora", 4 steps; "lora_resumed", steps 3 and 4 again from its own
    step-2 checkpoint (`--resume FOLDER`, into a fresh out_dir; the same 2 steps run again to write that checkpoint
    would add nothing), in the same processes (tests/train_worker.py: the resume builds another vLLM engine); then
    lora_exports."""
    tmp_path, tiny_model, synth = tmp_path_factory.mktemp("lora"), tiny_model_dir(), synth_dir()
    step2 = tmp_path / "full" / "ckpt" / "step_00000002"
    return Share(
        {
            "lora": run_args(tiny_model, synth, tmp_path / "full", "--max-steps", "4"),
            "lora_resumed": run_args(
                tiny_model, synth, tmp_path / "resumed", "--max-steps", "4", "--resume", str(step2)
            ),
        },
        after=lora_exports,
    )


@dataclass
class Exported:
    runs: Runs
    merged: str  # the full run's last checkpoint exported merged (scripts/export_hf.py --merge)
    adapter: str  # ... and as a PEFT adapter
    vllm_tokens: int  # vLLM's greedy tokens from the merged folder, in a fresh process


def lora_exports(runs: Runs) -> Exported:
    """After the launch, in the background lane: the full run's last checkpoint exported, vLLM on the merged one."""
    import export_hf

    tmp_path = runs["lora"].folder.parent
    merged = export_hf.export(
        str(tmp_path / "full" / "ckpt" / "latest"), str(tmp_path / "merged"), merge=True
    )
    adapter = export_hf.export(
        str(tmp_path / "full" / "ckpt" / "latest"), str(tmp_path / "adapter")
    )
    return Exported(runs, merged, adapter, vllm_greedy_tokens(merged))


@pytest.mark.slow
def test_two_ranks_vllm_agrees_resume_and_export(two_rank, tiny_model):
    lora = share_of(two_rank, __name__)
    run, again = lora.runs["lora"], lora.runs["lora_resumed"]
    tmp_path, log, merged, adapter = run.folder.parent, again.log, lora.merged, lora.adapter
    full, resumed = ({r["step"]: r for r in x.rows} for x in (run, again))  # step -> row
    # sampler (merged weights) and trainer (W x + s B A x) agree while B moves away from 0 (test_rollout's LOGP_TOL)
    assert all(full[s]["mismatch/max"] < 1e-2 for s in full) and full[4]["grad_norm"] > 0
    assert full[1]["kl"] == 0.0 and full[4]["kl"] > 0  # step 1: B = 0, the policy IS the reference
    base = load_file(f"{tiny_model}/model.safetensors")
    final = load_file(tmp_path / "full" / "final" / "model.safetensors")
    changed = {k for k in base if not torch.equal(base[k], final[k])}
    assert changed == {
        k
        for k in base
        if k.endswith(".weight")
        and any(
            f".{m}." in k
            for m in (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "qkv",
                "proj",
                "mlp.0",
                "mlp.2",
            )
        )
        and "patch_embed" not in k
    }
    # the checkpoint: adapters and their optimizer state only (the frozen base comes from `model`)
    import torch.distributed.checkpoint as dcp

    keys = (
        dcp.FileSystemReader(str(tmp_path / "full" / "ckpt" / "step_00000002"))
        .read_metadata()
        .state_dict_metadata
    )
    tensors = [k for k in keys if not k.startswith("optim.param_groups.")]
    assert tensors and all(".lora_" in k for k in tensors)
    # exact resume: steps 3 and 4 from the run's own step-2 checkpoint, bit-equal to the uninterrupted run; the resumed
    # run is the process's second train.main and second vLLM engine (the first run's close() kept the process group)
    assert f"resumed from {tmp_path / 'full' / 'ckpt' / 'step_00000002'}" in log and sorted(
        resumed
    ) == [3, 4]
    for s in (3, 4):
        for k in ("data/ids", "reward/mean", "loss", "grad_norm", "kl", "mismatch/mean"):
            assert resumed[s][k] == full[s][k], (s, k)
    # export: --merge is the run's own final folder; the PEFT adapter on the base gives the same weights
    assert all(
        torch.equal(v, final[k]) for k, v in load_file(f"{merged}/model.safetensors").items()
    )
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    assert sorted(os.listdir(adapter))[:2] == ["README.md", "adapter_config.json"]
    # the base by an absolute path: the adapter loads from any working directory
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert os.path.isabs(json.load(f)["base_model_name_or_path"])
    hf = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32)
    sd = PeftModel.from_pretrained(hf, adapter).merge_and_unload().state_dict()
    want = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32).state_dict()
    assert sd.keys() == want.keys() and all(torch.allclose(sd[k], want[k], atol=1e-6) for k in want)
    assert lora.vllm_tokens > 0

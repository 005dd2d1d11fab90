"""scripts/rehearse.py: a recipe's parallel layout for 2 steps on CPU (torchrun, gloo, vLLM) on a tiny checkpoint with
the real model's query and KV heads (the 4-rank rehearsal runs in tests/test_shares.py's 4-rank launch); a recipe that
cannot start fails before anything launches, with vLLM's error."""

import os

import pytest
import torch
from conftest import ROOT

import rehearse
import train

SEVEN_B_LONG = [
    os.path.join(ROOT, "configs", n) for n in ("qwen2_5_vl_7b.yaml", "qwen2_5_vl_7b_long.yaml")
]
THREE_B_LONG = [
    os.path.join(ROOT, "configs", n) for n in ("qwen2_5_vl_3b.yaml", "qwen2_5_vl_3b_long.yaml")
]


def test_the_rehearsal_keeps_the_layout_and_scales_the_lengths():
    """The recipe's layout and batch as they are; frames and lengths scaled down, one row per micro-batch kept."""
    c = rehearse.Config(config=tuple(SEVEN_B_LONG), out="runs/x")
    recipe = train.load_config(["--config", *SEVEN_B_LONG])
    args = rehearse.train_args(c, recipe, "tiny", "data")
    cfg = train.load_config(args)
    assert (cfg.sp_size, cfg.rollout_tp, cfg.group_size, cfg.prompts_per_step) == (8, 4, 8, 8)
    assert (
        cfg.max_tokens_per_micro_batch == cfg.max_prompt_len + cfg.max_response_len
    )  # one row, as the recipe
    assert cfg.video_max_frames == 16 and cfg.max_model_len <= 4096 and cfg.model == "tiny"
    assert not cfg.save and not cfg.offload and not cfg.wandb_project and cfg.cache_dir == ""


def test_a_recipe_vllm_refuses_fails_before_the_launch(tmp_path, monkeypatch):
    """The 7B hour recipe as it was (rollout_tp 8, 28 query heads): vLLM's own error, before any rank starts."""
    layer = tmp_path / "tp8.yaml"
    layer.write_text("rollout_tp: 8\n")
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    c = rehearse.Config(config=(*SEVEN_B_LONG, str(layer)), out=str(tmp_path / "run"))
    with pytest.raises(
        ValueError, match=r"heads \(28\) must be divisible by tensor parallel size \(8\)"
    ):
        rehearse.main(c)
    assert not (tmp_path / "run").exists()


def test_m_rope_takes_a_long_context_and_each_prompt_is_checked(monkeypatch):
    """max_model_len over the model's positions: an M-RoPE model's is admitted by vLLM's own config check through its
    text config's model_max_length (rollout.long_overrides; no VLLM_ALLOW_LONG_MAX_MODEL_LEN), the hour recipes'
    262,144 on Qwen2.5-VL's 128,000 too; a model without M-RoPE gets no override (vLLM refuses it); a prompt's M-RoPE
    positions plus max_response_len must stay under max_position_embeddings (VLLMEngine.check_positions), else a
    DataError names the sample."""
    import types

    from transformers import AutoConfig, AutoProcessor

    import cache
    import data
    import rollout
    import sp
    from conftest import synth_dir, tiny_model_dir

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    cfg = train.load_config(["--config", *THREE_B_LONG])  # the 7B's: test_memory_plan
    assert rollout.engine_errors(cfg.model, cfg.rollout_tp, cfg.max_model_len) == []
    tiny = tiny_model_dir()
    config = AutoConfig.from_pretrained(tiny)
    text = config.get_text_config().to_dict()
    assert text["max_position_embeddings"] == 4096 and rollout.engine_errors(tiny, 1, 8192) == []
    assert rollout.long_overrides(text, 8192) == {"text_config": {"model_max_length": 8192}}
    assert rollout.long_overrides(text, 4096) == {}
    plain = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling")}
    assert rollout.long_overrides(plain, 8192) == {}
    processor = AutoProcessor.from_pretrained(tiny)
    video = next(s for s in data.load_samples(f"{synth_dir()}/train.jsonl") if s.get("videos"))
    p = data.prepare(video, processor, cache.Media(cache_dir="", video_source="decode_only"))
    ids = torch.tensor([p.prompt_ids])
    last = int(sp.mrope_positions(ids, torch.ones_like(ids), data.grids([p], "cpu"), config).max())
    assert 0 < last < len(p.prompt_ids)  # a video's positions count its time steps, not its tokens
    engine = types.SimpleNamespace(positions=4096, config=config)
    rollout.VLLMEngine.check_positions(engine, p, 4095 - last)
    with pytest.raises(data.DataError, match=f"sample {video['id']}: its M-RoPE positions reach"):
        rollout.VLLMEngine.check_positions(engine, p, 4096 - last)

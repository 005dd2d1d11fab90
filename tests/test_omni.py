"""Audio-visual RL with the Omni thinkers (issue 45) on the real tiny checkpoints, a real vLLM engine each and a real
2-rank torchrun run (Qwen2.5-Omni): each video's soundtrack reaches both samplers AND the trainer's forward, and their
log-probs agree (Qwen2.5-Omni and Qwen3-Omni's MoE thinker); without the soundtrack in the trainer's forward (Long-RL's
path: the audio reaches vLLM only) they do not.

    .venv/bin/python -m pytest -q tests/test_omni.py
"""

import json
import os

import pytest
import torch
from conftest import (
    another_engine,
    ROOT,
    Share,
    share_of,
    tiny_config,
    trainer_logp_diff,
    two_rank_share,
)

import data
import train
from rollout import HFEngine, eos_token_ids

pytestmark = pytest.mark.slow  # a vLLM engine, a torchrun run

LOGP_TOL = 1e-4  # test_rollout's: fp32 on this CPU
# the soundtrack left out of the trainer's forward, or another video's (another pitch), moves log-probs by far more:
# measured 0.39 and 7.9e-3 on the random tiny model (LOG.md session 11); the agreement is 1e-6
DEAF = 1e-3
# a 2 s soundtrack's tokens: 25 a second (Qwen2.5-Omni), 13 for each full second of 100 mel frames (Qwen3-Omni)
AUDIO_TOKENS = {"qwen2_5_omni": 50, "qwen3_omni_moe": 26}


def omni_dir(arch: str = "qwen2_5_omni") -> str:
    import make_tiny_model

    return make_tiny_model.ensure(arch, root=os.path.join(ROOT, ".cache/models"))


def tone_dir() -> str:
    """The "tone" task (the answer in the soundtrack only): 8 train and 4 held-out samples."""
    import make_synthetic_data

    out = os.path.join(ROOT, ".cache/data/omni_tone")
    make_synthetic_data.make(
        out, ["tone"], num_train=8, num_val=4, seed=0, size=56, fps=4, seconds=2.0
    )
    return out


@pytest.fixture(scope="module", params=AUDIO_TOKENS)
def omni(request):
    """The arch, the processor, the thinker as the trainer loads it (one process: no FSDP), 3 prompts with their
    videos' soundtracks (3 pitches), and an engine of its own."""
    from transformers import AutoProcessor

    folder = omni_dir(request.param)
    cfg = tiny_config(model=folder, video_audio=True)
    proc = AutoProcessor.from_pretrained(folder)
    model = train.load_model(cfg, torch.device("cpu")).eval()
    samples = data.load_samples(os.path.join(tone_dir(), "train.jsonl"))
    picked = [next(s for s in samples if s["answer"] == a) for a in "ABC"]
    prompts = [data.prepare(s, proc, cfg) for s in picked]
    engine = another_engine(folder, proc.tokenizer)
    yield request.param, proc, model, prompts, engine
    engine.close()


def deaf(rollouts: list) -> list:
    """The rollouts with their prompts' soundtrack features removed: the audio placeholders stay, as Long-RL's
    trainer forward leaves them (pixel values only)."""
    mute = {}
    for r in rollouts:
        p = r.prompt
        if id(p) not in mute:
            mm = {
                k: v
                for k, v in p.mm.items()
                if k not in ("input_features", "feature_attention_mask")
            }
            mute[id(p)] = data.Prompt(p.sample, p.text, p.prompt_ids, mm, p.videos)
        r.prompt = mute[id(p)]
    return rollouts


def test_omni_samplers_agree_with_trainer(omni):
    """vLLM's and the HF sampler's log-probs on video + soundtrack prompts are the trainer's (LOGP_TOL): the same
    interleaved prompt ids (else generate raises), the same TMRoPE positions, the soundtrack encoded in the trainer's
    forward. The trainer that drops the soundtrack, or hears another video's, is off by more than DEAF. After a
    weight sync (Qwen2.5-Omni: the published "thinker." names; Qwen3-Omni: vLLM maps the thinker's own, its fused
    experts as transformers holds them) vLLM samples from the new weights."""
    arch, proc, model, prompts, engine = omni
    tok = proc.tokenizer
    assert all(p.audios and "input_features" in p.mm for p in prompts)
    # each soundtrack padded to the 30 s window (Qwen3-Omni's processor pads to a call's longest): a batch stacks
    assert all(p.mm["input_features"].shape[-1] == 3000 for p in prompts)
    n_audio = AUDIO_TOKENS[arch]
    assert all(p.prompt_ids.count(model.config.audio_token_id) == n_audio for p in prompts)
    rollouts = engine.generate(prompts, n=4, temperature=1.0, max_tokens=12, seed=1)
    exact = trainer_logp_diff(model, rollouts, tok)
    hf = HFEngine(model, tok, eos_token_ids(model))
    hf_exact = trainer_logp_diff(model, hf.generate(prompts, 3, 1.0, 6, seed=5), tok)
    # Long-RL's path: the audio reaches vLLM, never the trainer
    longrl = trainer_logp_diff(model, deaf(engine.generate(prompts, 2, 1.0, 6, seed=3)), tok)
    # another video's soundtrack: a class's pitch moves the log-probs
    swapped = engine.generate(prompts[:2], 2, 1.0, 6, seed=4)
    for r in swapped:
        r.prompt = prompts[1 - prompts.index(r.prompt)]
    other = trainer_logp_diff(model, swapped, tok)
    print(f"{arch}: vLLM {exact:.2e}, HF {hf_exact:.2e}, deaf {longrl:.2e}, swapped {other:.2e}")
    assert exact < LOGP_TOL and hf_exact < LOGP_TOL
    assert longrl > DEAF and other > DEAF
    new = train.load_model(tiny_config(model=omni_dir(arch)), torch.device("cpu")).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.01 * torch.randn_like(p))
    stale = trainer_logp_diff(new, engine.generate(prompts, 2, 1.0, 6, seed=2), tok)
    engine.sync(new)
    synced = trainer_logp_diff(new, engine.generate(prompts, 2, 1.0, 6, seed=2), tok)
    print(f"{arch} sync: stale {stale:.2e}, synced {synced:.2e}")
    assert stale > 0.1 and synced < LOGP_TOL, (stale, synced)


@two_rank_share
def omni_runs(tmp_path_factory) -> Share:
    """One run in conftest's shared 2-rank launch: 2 GRPO steps of the tiny Omni on the tone task with vLLM, FSDP2
    (fsdp reshard: the thinker's layers, vision tower and audio tower each a unit) and LoRA."""
    out = tmp_path_factory.mktemp("omni")
    data_dir = tone_dir()
    args = [
        "--config",
        "configs/tiny_omni_cpu.yaml",
        "configs/lora.yaml",
        "--model",
        omni_dir(),
        "--train-data",
        f"{data_dir}/train.jsonl",
        "--val-data",
        "",
        "--out-dir",
        str(out / "run"),
        "--cache-dir",
        str(out / "frames"),
        "--group-size",
        "4",
        "--prompts-per-step",
        "4",
        "--max-steps",
        "2",
        "--fsdp",
        "reshard",
    ]
    return Share({"omni": args})


def test_omni_fsdp_lora_run(two_rank):
    """2 ranks, FSDP2 and LoRA: the sampler (merged weights) and the trainer agree on every step (test_lora's
    tolerance) and the adapters move."""
    run = share_of(two_rank, __name__)["omni"]
    rows = {r["step"]: r for r in run.rows}
    assert sorted(rows) == [1, 2], run.log[-3000:]
    assert all(r["mismatch/max"] < 1e-2 and r["grad_norm"] > 0 for r in rows.values())


def test_omni_worldsense_async_engine(two_rank, tmp_path):
    """The 2-rank run's final folder (ckpt.save_checkpoint: the thinker's weights, LoRA merged, under "thinker." in
    the whole model's config: the published layout vLLM's registry loads) through evaluate.py's async pipeline
    (AsyncLLM, loader threads, the frame and sound cache) on WorldSense in its official audio-visual setting: each
    video's soundtrack decoded, cached, sent; the rows scored by WorldSense's reader, none unevaluable."""
    import asyncio

    import evaluate as E
    import numpy as np
    from make_synthetic_data import write_video

    videos = tmp_path / "videos" / "worldsense"
    videos.mkdir(parents=True)
    write_video(str(videos / "ws0.mp4"), np.zeros((8, 56, 56, 3), np.uint8), 4.0, tone=440.0)
    final = share_of(two_rank, __name__)["omni"].folder / "final"
    with open(final / "config.json") as f:
        assert "thinker_config" in json.load(f)
    cfg = E.Config(
        model=str(final),
        benchmarks="worldsense",
        data_dir=os.path.join(ROOT, "tests/fixtures/benchmarks"),
        video_dir=str(tmp_path / "videos"),
        out_dir=str(tmp_path / "out"),
        cache_dir=str(tmp_path / "frames"),
        max_tokens=4,
        max_model_len=1024,
        video_fps=4.0,
        video_max_frames=8,
        video_max_pixels=3136,
        dtype="float32",
        gpu_memory_utilization=0.1,
    )
    res = asyncio.run(E.evaluate(cfg))["worldsense"]
    rows = [json.loads(line) for line in open(tmp_path / "out" / "worldsense" / "samples.jsonl")]
    assert res["unevaluable"] == 0 and [r["doc_id"] for r in rows] == ["0"], res
    assert "the corresponding audio" in rows[0]["input"] and rows[0]["resps"]
    assert len(os.listdir(tmp_path / "frames")) >= 1  # the frames' and the sound's entries

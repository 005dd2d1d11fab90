"""Rehearse a recipe's parallel layout on CPU before a GPU node runs it: its world size, sp_size, rollout_tp, group and
batch sizes, micro-batch policy, KL reference and vision settings, for 2 steps of train.py under torchrun (gloo) with
vLLM, on a tiny checkpoint with the real model's query and KV head counts (make_tiny_model's heads<Q>-<KV> variants:
width 64 per head, 2 layers) and short synthetic videos (frames and lengths scaled down). A recipe that cannot start
fails here with the error a GPU node would give: check_config on the recipe itself (vLLM's own config checks on the
published model, rollout.engine_errors), then vLLM's engines built on the real head counts.

    python scripts/rehearse.py --config configs/qwen2_5_vl_7b.yaml configs/qwen2_5_vl_7b_long.yaml      # 8 ranks
    python scripts/rehearse.py --config configs/qwen2_5_vl_3b.yaml configs/qwen2_5_vl_3b_long.yaml --ranks 8

What is not the recipe's: the model (the tiny one, fp32), frames (video_max_frames `frames`, 56 x 56 px), prompt,
response and model lengths (max_tokens_per_micro_batch keeps the recipe's rows per micro-batch), offload (CUDA only),
the frame cache, checkpoints and wandb (off).
"""

import dataclasses
import json
import os
import subprocess
import sys

from repo import ROOT, torchrun

PROMPT_LEN = 1024  # the rehearsal's max_prompt_len (a 16-frame 56 x 56 question is ~100 tokens)
RESPONSE_LEN = 16


@dataclasses.dataclass
class Config:
    config: tuple[str, ...] = ()
    """the recipe: train.py YAMLs, each over the ones before it, as train.py --config"""
    ranks: int = 0
    """world size; 0: the N of the recipe's launch line (`torchrun --nproc_per_node=N train.py`)"""
    steps: int = 2
    """training steps"""
    frames: int = 16
    """video_max_frames (the recipe's, scaled down); the synthetic clips hold 16 frames"""
    out: str = "runs/rehearse"
    """run folder"""
    timeout: float = 3600.0
    """seconds before the launch is stopped"""


def tiny_model(model: str) -> str:
    """The tiny checkpoint of the recipe model's family with its query and KV head counts (built once)."""
    import make_tiny_model
    import memory_plan

    spec = memory_plan.stored(model, "bfloat16")[0]
    text = spec["text_config"]
    # make_tiny_model's variant of the published (query heads, KV heads)
    variant = f"heads{text['num_attention_heads']}-{text['num_key_value_heads']}"
    if variant not in make_tiny_model.VARIANTS or spec["model_type"] == "qwen2_vl":
        sys.exit(
            f"{model}: no tiny checkpoint with {text['num_attention_heads']} / {text['num_key_value_heads']} heads "
            "(make_tiny_model.VARIANTS)"
        )
    return make_tiny_model.ensure(spec["model_type"], variant=variant)


def train_args(c: Config, cfg, model: str, data_dir: str) -> list[str]:
    """train.py's command line: the recipe, then what a CPU rehearsal changes (the module docstring)."""
    rows = 0  # max_tokens_per_micro_batch 0: micro_batch_size rows, as the recipe
    if cfg.max_tokens_per_micro_batch:
        rows = max(1, cfg.max_tokens_per_micro_batch // (cfg.max_prompt_len + cfg.max_response_len))
    overrides = {
        "--model": model,
        "--train-data": os.path.join(data_dir, "train.jsonl"),
        "--val-data": os.path.join(data_dir, "val.jsonl"),
        "--out-dir": c.out,
        "--max-steps": c.steps,
        "--eval-every": 0,
        "--video-fps": 4.0,
        "--video-min-frames": 4,
        "--video-max-frames": c.frames,
        "--video-min-pixels": 3136,
        "--video-max-pixels": 3136,
        "--video-total-pixels": 0,
        "--image-min-pixels": 3136,
        "--image-max-pixels": 3136,
        "--max-prompt-len": PROMPT_LEN,
        "--max-response-len": RESPONSE_LEN,
        "--max-model-len": PROMPT_LEN + RESPONSE_LEN,
        "--max-tokens-per-micro-batch": rows * (PROMPT_LEN + RESPONSE_LEN),
        "--cache-dir": "",
        "--video-source": "decode_only",
        "--wandb-project": "",
    }
    flags = [str(x) for pair in overrides.items() for x in pair]
    return ["--config", *c.config, *flags, "--no-save", "--no-offload"]


def prepare(c: Config, cfg, ranks: int, layout: str) -> list[str]:
    """train.py's checks of the recipe on `ranks` ranks, the tiny checkpoint and the synthetic data: the
    rehearsal's train.py command line (tests/test_shares.py runs it in its 4-rank launch)."""
    import make_synthetic_data
    import train

    # what a GPU node's train.py refuses first; offload needs CUDA, which this CPU rehearsal drops
    train.check_config(dataclasses.replace(cfg, offload=False), ranks)
    model = tiny_model(cfg.model)
    data_dir = os.path.join(ROOT, ".cache/data/rehearse")
    make_synthetic_data.make(
        data_dir, ["color"], num_train=64, num_val=8, seconds=4.0
    )  # 56x56, 4 fps
    print(f"rehearsing {' '.join(c.config)}: {layout}, {model}", flush=True)
    return train_args(c, cfg, model, data_dir)


def verdict(c: Config, rc: int, layout: str) -> int:
    """Prints whether the run of c.out finished its c.steps steps with exit status rc; 0 if so."""
    steps = []
    metrics = os.path.join(c.out, "metrics.jsonl")
    if os.path.exists(metrics):  # main removed a previous rehearsal's
        with open(metrics) as f:
            steps = [r for r in map(json.loads, f) if "dyn/rounds" in r]
    rounds = [r["dyn/rounds"] for r in steps]
    ok = rc == 0 and len(steps) == c.steps
    word = "REHEARSED" if ok else f"FAILED (exit {rc})"
    print(f"{word}: {layout}; {len(steps)} of {c.steps} steps, generation rounds per step {rounds}")
    return 0 if ok else 1


def main(c: Config) -> int:
    """Checks the recipe as train.py does on `ranks` ranks, then launches the rehearsal; returns its exit status."""
    import memory_plan
    import train

    ranks = c.ranks or memory_plan.launch_ranks(c.config, "--ranks")
    cfg = train.load_config(["--config", *c.config])
    layout = f"{ranks} ranks, sp_size {cfg.sp_size}, rollout_tp {cfg.rollout_tp}"
    args = prepare(c, cfg, ranks, layout)
    # a KV cache of 256 MiB a rank (rollout.py's 1 GiB is resident on vLLM's CPU backend): 8 ranks in ~12 GiB
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("CPU_KV_CACHE_MIB", "256")
    metrics = os.path.join(c.out, "metrics.jsonl")
    if os.path.exists(metrics):  # a previous rehearsal's
        os.remove(metrics)
    try:
        rc = subprocess.run(
            torchrun(ranks, "train.py", *args),
            cwd=ROOT,
            env=env,
            timeout=c.timeout,
        ).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    return verdict(c, rc, layout)


if __name__ == "__main__":
    import tyro

    sys.exit(main(tyro.cli(Config)))

"""train.py: GRPO-family RL for video (and image) VLMs, in one file you read top to bottom.

    python train.py --config configs/tiny_cpu.yaml                                      # one process
    torchrun --nproc_per_node=2 train.py --config configs/tiny_cpu.yaml configs/dapo.yaml   # 2 CPU ranks, a recipe
    torchrun --nproc_per_node=8 train.py --config configs/qwen2_5_vl_7b.yaml            # one 8-GPU node (nccl)

Every rank runs the same loop (SPMD, no controller): FSDP2 shards the policy, a vLLM engine lives in the same
process (rollout.py) and gets the new weights after every optimizer step. A step, as main's section banners say:
sample and score groups (DAPO dynamic sampling), old/ref log-probs, advantages on the global batch, ppo_epochs x
mini_batches optimizer steps, weight sync. The math follows verl 0.9.1; docs/algorithms.md gives every formula and
each deliberate deviation.
"""
import dataclasses
import datetime
import functools
import importlib.util
import itertools
import json
import math
import os
import re
import sys
import time
import typing
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist

import cache
import ckpt
import data
import evaluate
import rewards
import sp
from ckpt import all_reduce, gather, init_dist, print0, save_checkpoint
from rollout import HFEngine, Rollout, VLLMEngine, mm_token_types, request_seed, vision_token_ids
from scripts import plot_runs


@dataclass
class Config(cache.Media):
    config: tuple[str, ...] = ()
    """YAML files setting the defaults, each over the ones before (unknown keys, mistyped values fail); flags win"""
    dry_run: bool = False
    """check the config and the data, print the resolved config, the data counts and the longest prompt; then exit"""
    # --- model and data
    model: str = ".cache/models/tiny-qwen2_5_vl"
    """HF model folder (Qwen2-VL, Qwen2.5-VL or Qwen3-VL)."""
    train_data: str = ".cache/data/color/train.jsonl"
    """training samples (JSONL or JSON array; schema in data.py)"""
    val_data: str = ".cache/data/color/val.jsonl"
    """held-out samples for greedy accuracy ('' to skip evaluation)"""
    out_dir: str = "runs/tiny"
    """run folder: metrics.jsonl, curve.png, skipped.jsonl, checkpoints"""
    trust_remote_code: bool = False
    """let transformers/vLLM run code shipped with the checkpoint (off: only trusted, built-in models)"""
    skip_invalid: bool = False
    """skip (count, log, report) invalid samples instead of stopping at the first one"""
    max_consecutive_invalid: int = 1000
    """skip_invalid: more invalid samples in a row than this fail the run (the data set may hold no valid sample)"""
    prompt_template: str = ""
    """path to a Jinja2 template for the user prompt ('' = per-problem-type defaults in data.py)"""
    max_prompt_len: int = 4096
    """prompts longer than this (in tokens, vision included) are an error: never silently truncated"""
    # --- frames: the training budget is cache.Media's fields (video_*, image_*, video_source, cache_dir)
    val_video_fps: float = 0.0
    """validation frame budget: fps (0 = the training value); likewise the val_* fields below"""
    val_video_max_frames: int = 0
    """validation: max frames per video (0 = video_max_frames)"""
    val_video_max_pixels: int = 0
    """validation: max pixels per frame (0 = video_max_pixels)"""
    val_video_total_pixels: int = 0
    """validation: pixel budget over a video's frames (0 = video_total_pixels)"""
    val_image_max_pixels: int = 0
    """validation: max pixels per image (0 = image_max_pixels)"""
    # --- rollout
    rollout: Literal["vllm", "hf"] = "vllm"
    """sampler: vllm (colocated engine) | hf (transformers generate on the training model)"""
    rollout_tp: int = 1
    """vLLM tensor parallel size: 1 = an engine per rank, world size = one engine over all ranks"""
    group_size: int = 8
    """completions per prompt (n)"""
    prompts_per_step: int = 8
    """prompts per optimizer step, over all ranks (divisible by the data-parallel size, world / sp_size)"""
    temperature: float = 1.0
    """sampling temperature; the trainer's log-probs use the same one"""
    max_response_len: int = 64
    """max new tokens per completion"""
    max_model_len: int = 4096
    """vLLM context length"""
    gpu_memory_utilization: float = 0.4
    """vLLM's share of GPU memory (colocated with training)"""
    vllm_sleep: bool = True
    """sleep vLLM during the train phase where the platform supports it (CUDA)"""
    mix_offline: bool = True
    """a sample's offline_output replaces the last rollout of its group"""
    mix_threshold: float = 0.0
    """swap only when the group's online accuracy is below this (0 = always): trained as on-policy, logged offline/*"""
    # --- reward
    w_acc: float = 0.9
    """weight of the accuracy reward"""
    w_fmt: float = 0.1
    """weight of the format reward"""
    response_format: Literal["answer", "think_answer"] = "answer"
    """what the default prompts ask for and the format reward checks: <answer>..</answer>, or <think>..</think> first"""
    # --- algorithm (verl 0.9.1 definitions; configs/<algorithm>.yaml name the combinations)
    adv_estimator: Literal["grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline", "remax", "gdpo"] = "grpo"
    """grpo | drgrpo (no std division) | rloo | reinforce++ | reinforce++-baseline | remax | gdpo"""
    adv_eps: float = 1e-6
    """epsilon in (r - mean) / (std + eps)"""
    loss_type: Literal["ppo", "gspo", "cispo"] = "ppo"
    """ppo (PPO-clip, dual-clip) | gspo (sequence-level ratio) | cispo (clipped detached IS weight x logp)"""
    clip_low: float = 0.2
    """clip: ratio >= 1 - clip_low"""
    clip_high: float = 0.2
    """clip: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)"""
    clip_ratio_c: float = 3.0
    """dual-clip (ppo): a token with A < 0 loses at most clip_ratio_c * |A|; > 1, or 0 = off"""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = \
        "token-mean"
    """how token losses become the batch loss (seq-mean-token-sum-norm: Dr.GRPO)"""
    kl_coef: float = 0.0
    """KL-to-reference coefficient (0 = no reference model is loaded)"""
    kl_type: Literal["k1", "abs", "k2", "k3"] = "k3"
    """KL estimator: k1 | abs | k2 | k3 (low_var_kl, clamped)"""
    kl_in_reward: bool = False
    """subtract kl_coef * KL(old || ref) from the return instead of a KL loss (reinforce++, remax: from each token)"""
    entropy_coef: float = 0.0
    """entropy bonus: loss -= entropy_coef * aggregated entropy (entropy is logged either way)"""
    tis: Literal["", "token", "sequence"] = ""
    """truncated importance sampling pi_old / pi_rollout: '' (off) | token | sequence"""
    tis_cap: float = 2.0
    """upper bound of that importance weight"""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """truncate (w = min(w, cap)) | mask (w = 0 where w > cap)"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose dyn_filter_metric is the same for every rollout, generate more until the batch is full"""
    dyn_filter_metric: Literal["accuracy", "reward"] = "accuracy"
    """dynamic sampling filters on: accuracy (DAPO, verl's recipe) | reward (the overall reward, penalties included)"""
    max_gen_rounds: int = 4
    """dynamic sampling: generation rounds per step at most (then dropped groups fill the batch, logged)"""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty: linear from 0 to -overlong_factor over the last N tokens (0 = off)"""
    overlong_factor: float = 1.0
    """size of the overlong penalty at max_response_len"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    mini_batches: int = 1
    """optimizer steps per pass: the rollout batch is split into this many mini-batches"""
    micro_batch_size: int = 16
    """sequences per forward/backward on each rank"""
    # --- memory
    freeze_vision: bool = False
    """no gradient into the vision tower: its features are computed once per prompt per step and reused by every pass"""
    logp_chunk: int = 1024
    """response positions projected onto the vocabulary at a time (recomputed in backward; 0 = all at once)"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's and vision block's activations in backward instead of keeping them"""
    offload: bool = False
    """FSDP2 CPU offload: parameter shards, gradients and optimizer state in CPU memory (CUDA, torchrun only)"""
    max_tokens_per_micro_batch: int = 0
    """micro-batch budget in padded tokens, rows x (longest prompt + response); replaces micro_batch_size (0 = off)"""
    sp_size: int = 1
    """sequence parallelism (sp.py): sp_size ranks train the same rows, each 1/sp_size of the tokens and frames"""
    # --- optimizer
    lr: float = 1e-6
    """peak learning rate"""
    min_lr_ratio: float = 0.1
    """cosine decays to lr * min_lr_ratio at max_steps"""
    warmup_steps: int = 0
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """max global grad norm"""
    max_steps: int = 100
    """optimizer steps"""
    seed: int = 0
    """seed for data order, sampling and init"""
    # --- log, eval, save
    eval_every: int = 0
    """greedy held-out accuracy every N steps (0 = only before and after training)"""
    eval_max_samples: int = 256
    """cap on held-out samples per evaluation"""
    save: bool = True
    """save an HF-format checkpoint (loads in vLLM and transformers) at the end"""
    wandb_project: str = ""
    """wandb project ('' = off); online, offline or disabled as `wandb login` and WANDB_MODE say"""
    log_every: int = 1
    """write sampled completions to out_dir/samples.jsonl (and a wandb table) every N steps (0 = never)"""
    log_samples: int = 4
    """completions written per logged step: the first of each of that many groups"""
    # --- long runs (checkpoint section)
    save_every: int = 0
    """sharded checkpoint out_dir/ckpt/step_N every N steps (0 = only on SIGTERM/SIGINT), see scripts/export_hf.py"""
    keep_last: int = 2
    """checkpoints kept, older ones are deleted (0 = keep all)"""
    resume: str = ""
    """'' = start fresh | auto = the latest complete checkpoint in out_dir/ckpt (fresh if none) | a folder"""
    dist_timeout: float = 1800.0
    """seconds a collective may wait: a dead or stuck rank fails the run instead of hanging it"""
    # --- LoRA (peft): the base model stays frozen, only the adapters train
    lora_rank: int = 0
    """adapter rank r (0 = full fine-tuning); the reference policy is then the model with its adapters scaled to 0"""
    lora_alpha: float = 16.0
    """the adapter's update is lora_alpha / lora_rank * B A"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input during the loss forward (the log-prob passes and the sampler have none)"""
    lora_targets: str = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    """regex over module names (full match) that get adapters (default: the language model's attention and MLP);
    the vision tower and merger are optional, e.g. append `|.*visual.blocks.*(qkv|proj)|.*merger.mlp.[02]`"""


def load_config(argv=None) -> Config:
    """`--config a.yaml [b.yaml ...]` set the defaults, each file over the ones before it; the other flags override
    them. configs/tiny_cpu.yaml holds a run's settings, configs/<algorithm>.yaml a recipe."""
    import tyro
    argv = list(sys.argv[1:] if argv is None else argv)
    base = Config()
    if "--config" in argv:
        for path in itertools.takewhile(lambda arg: not arg.startswith("--"), argv[argv.index("--config") + 1:]):
            base = yaml_overlay(base, path)
    return tyro.cli(Config, default=base, args=argv)


FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", re.I)  # YAML 1.1 floats need a dot: 1e-6 is a str, made float


def yaml_overlay(base: Config, path: str) -> Config:
    """A YAML file's values over `base`, each checked against its field's type (an error names the file and the key)."""
    import yaml
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    types = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "config"}
    for key, value in values.items():
        if key not in types:
            raise ValueError(f"{path}: unknown key {key!r}")
        choices = typing.get_args(types[key]) if typing.get_origin(types[key]) is Literal else ()
        if types[key] is float and (type(value) is int or type(value) is str and FLOAT.fullmatch(value)):
            value = float(value)
        if value not in choices and type(value) is not types[key]:  # type(): a bool is no int here
            raise ValueError(f"{path}: {key}: {value!r} is not {' | '.join(map(repr, choices)) or types[key].__name__}")
        base = replace(base, **{key: value})
    return base


def check_config(cfg: Config, world: int = 1):
    """Every setting and combination that cannot work fails here, all of them in one error, before anything loads."""
    choices = {f.name: typing.get_args(f.type) for f in dataclasses.fields(cfg) if typing.get_origin(f.type) is Literal}
    bad = [f"{k} is {getattr(cfg, k)!r}, not one of {v}" for k, v in choices.items() if getattr(cfg, k) not in v]
    positive = ("group_size", "prompts_per_step", "max_response_len", "max_prompt_len", "micro_batch_size", "lr",
                "ppo_epochs", "mini_batches", "max_steps", "max_gen_rounds", "rollout_tp", "video_min_frames",
                "log_samples", "video_fps", "tis_cap", "gpu_memory_utilization", "dist_timeout", "sp_size")
    not_negative = ("kl_coef", "entropy_coef", "w_acc", "w_fmt", "weight_decay", "warmup_steps", "overlong_buffer",
                    "eval_every", "eval_max_samples", "save_every", "keep_last", "clip_low", "clip_high",
                    "mix_threshold", "log_every", "video_total_pixels", "adv_eps")
    bad += [f"{k} must be > 0, got {getattr(cfg, k)}" for k in positive if getattr(cfg, k) <= 0]
    bad += [f"{k} must be >= 0, got {getattr(cfg, k)}" for k in not_negative if getattr(cfg, k) < 0]
    dp = world // max(1, cfg.sp_size)  # data-parallel ranks: an SP group trains the same rows
    per_rank = cfg.prompts_per_step // max(1, dp) * cfg.group_size  # rollouts per rank and step
    bad += [message for fails, message in [
        (dp and cfg.prompts_per_step % dp, f"prompts_per_step {cfg.prompts_per_step} % data-parallel size {dp} != 0"),
        (world % cfg.rollout_tp, f"world size {world} % rollout_tp {cfg.rollout_tp} != 0"),
        (cfg.sp_size > 0 and world % cfg.sp_size, f"world size {world} % sp_size {cfg.sp_size} != 0"),
        (cfg.sp_size > 1 and cfg.rollout_tp not in (1, cfg.sp_size), "sp_size > 1 needs rollout_tp 1 or sp_size"),
        (cfg.rollout == "hf" and cfg.rollout_tp > 1, "rollout_tp > 1 needs rollout vllm"),
        (cfg.mini_batches > per_rank, f"mini_batches {cfg.mini_batches} > {per_rank} rollouts per rank and step"),
        (cfg.clip_ratio_c and cfg.clip_ratio_c <= 1, f"clip_ratio_c {cfg.clip_ratio_c} must be > 1 (or 0 = off)"),
        (not 0 <= cfg.min_lr_ratio <= 1, f"min_lr_ratio {cfg.min_lr_ratio} must be in [0, 1]"),
        (cfg.gpu_memory_utilization > 1, f"gpu_memory_utilization {cfg.gpu_memory_utilization} must be <= 1"),
        (cfg.mix_threshold > 1, f"mix_threshold {cfg.mix_threshold} must be <= 1 (an accuracy)"),
        (cfg.mix_threshold and not cfg.mix_offline, "mix_threshold needs mix_offline"),
        (cfg.overlong_buffer > cfg.max_response_len, "overlong_buffer > max_response_len"),
        (cfg.rollout == "vllm" and cfg.max_prompt_len > cfg.max_model_len, "max_prompt_len > max_model_len"),
        (cfg.video_min_frames > cfg.video_max_frames, "video_min_frames > video_max_frames"),
        (cfg.video_min_pixels > cfg.video_max_pixels, "video_min_pixels > video_max_pixels"),
        (cfg.image_min_pixels > cfg.image_max_pixels, "image_min_pixels > image_max_pixels"),
        (cfg.video_source == "cache_only" and not cfg.cache_dir, "video_source cache_only needs a cache_dir"),
        (cfg.kl_in_reward and not cfg.kl_coef, "kl_in_reward needs kl_coef > 0 (0 loads no reference model)"),
        (cfg.kl_in_reward and cfg.adv_estimator == "gdpo", "kl_in_reward: gdpo's reward components carry no KL"),
        (cfg.resume not in ("", "auto") and not os.path.isdir(cfg.resume), f"resume {cfg.resume!r}: no such folder"),
        (cfg.temperature < 1e-5, f"temperature {cfg.temperature} must be >= 1e-5 (vLLM samples greedily below it, "
         "and greedy rollouts cannot be trained: the trainer's logits / 0 are NaN)"),
        (cfg.lora_rank < 0, f"lora_rank {cfg.lora_rank} must be >= 0 (0 = full fine-tuning)"),
        (not 0 <= cfg.lora_dropout < 1, f"lora_dropout {cfg.lora_dropout} must be in [0, 1)"),
        (cfg.offload and not (torch.cuda.is_available() and dist.is_initialized()),
         "offload: FSDP2's CPU offload of GPU memory needs CUDA and torchrun"),
        (0 < cfg.max_tokens_per_micro_batch < cfg.max_prompt_len + cfg.max_response_len,
         f"max_tokens_per_micro_batch {cfg.max_tokens_per_micro_batch} < max_prompt_len + max_response_len "
         f"{cfg.max_prompt_len + cfg.max_response_len}: the longest row fits in none"),
    ] if fails]
    if bad:
        raise ValueError("invalid config:\n  " + "\n  ".join(bad))


def dry_run(cfg: Config, processor, template, samples: dict, skipped: list):
    """--dry-run: the resolved config (YAML that --config reads back), the data counts and, per split, the prompt
    length of the sample with the most media and the longest text (processor-expanded, vision tokens included)."""
    import yaml
    resolved = {k: v for k, v in asdict(cfg).items() if k not in ("config", "dry_run")}  # a YAML --config reads
    print(yaml.safe_dump(resolved, sort_keys=False), end="")
    print(f"data: {', '.join(f'{len(v)} {k}' for k, v in samples.items())}, {len(skipped)} skipped")
    for (split, rows), split_cfg in zip(samples.items(), (cfg, val_config(cfg))):
        if rows:
            longest = max(rows, key=lambda s: (len(s.get("videos", []) + s.get("images", [])), len(
                processor.tokenizer(data.render_prompt(s, template, cfg.response_format)).input_ids)))
            prompt = data.prepare(longest, processor, split_cfg, template=template, response_format=cfg.response_format)
            print(f"{split}: longest prompt {len(prompt.prompt_ids)} tokens (sample {longest['id']}, max_prompt_len "
                  f"{cfg.max_prompt_len})")


def val_config(cfg: Config) -> Config:
    """The frame budget of the held-out prompts: each val_* field that is set replaces its training field."""
    fields = ("video_fps", "video_max_frames", "video_max_pixels", "video_total_pixels", "image_max_pixels")
    return replace(cfg, **{k: getattr(cfg, f"val_{k}") for k in fields if getattr(cfg, f"val_{k}")})


# ---------------------------------------------------------------------------------------------------
# The algorithm: small pure tensor functions. B = sequences, R = response tokens.

def whiten(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten, (x - mean) / sqrt(var + 1e-8) with token-weighted mean and unbiased variance, on
    per-token values x, mask (B, R), or on per-sequence values x, lengths (B,) (each counted once per token)."""
    w = weight.to(x.dtype)
    n = w.sum()
    mean = (w * x).sum() / n
    var = (w * (x - mean) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def reward_to_go(x: torch.Tensor) -> torch.Tensor:
    """Sum from each token to the end of its row (gamma 1): (B, R) -> (B, R)."""
    return x.flip(-1).cumsum(-1).flip(-1)


def advantages(reward: torch.Tensor, group_size: int, estimator: str = "grpo", lengths=None, baseline=None,
               components=None, kl_to_go=None, eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantages (B,) from rewards (B,) in groups of group_size consecutive rows, in float64 (docs/
    algorithms.md). lengths (B,): whitening weights; baseline (B,): remax; components: (B,) each, gdpo. kl_to_go
    (B, R), kl_in_reward: reinforce++ and remax return (B, R) from each token's return, the others lose the row's KL."""
    reward = reward.double()
    if kl_to_go is not None and estimator in ("reinforce++", "remax"):
        mask = (torch.arange(kl_to_go.shape[1])[None] < lengths[:, None]).double()           # (B, R)
        returns = (reward[:, None] - kl_to_go.double()) * mask                                # (B, R)
        if estimator == "remax":
            return (returns - baseline.double()[:, None]) * mask
        return whiten(returns, mask) * mask
    if kl_to_go is not None:
        reward = reward - kl_to_go[:, 0]                                                      # the sequence's KL
    r = reward.view(-1, group_size)                                                           # (G, n)
    centered, std = r, torch.ones_like(r)                                                     # a group of 1
    if group_size > 1:
        std = r.std(-1, keepdim=True)                                                         # (G, 1)
        same = (r == r[:, :1]).all(-1, keepdim=True)                                          # (G, 1)
        centered = torch.where(same, 0.0, r - r.mean(-1, keepdim=True))  # exactly 0, not r - mean's rounding
    if estimator == "grpo":
        return (centered / (std + eps)).view(-1)
    if estimator == "drgrpo":
        return centered.view(-1)
    if estimator == "rloo":  # r_i - mean of the others = n / (n - 1) * (r_i - mean); a group of 1: r_i
        return (centered * group_size / max(1, group_size - 1)).view(-1)
    if estimator == "reinforce++":
        return whiten(reward, lengths)
    if estimator == "reinforce++-baseline":
        return whiten(centered.view(-1), lengths)
    if estimator == "remax":
        return reward - baseline.double()
    if estimator == "gdpo":  # GRPO per reward component, summed (equal weights), then batch-whitened
        summed = sum(advantages(c, group_size, "grpo", eps=eps) for c in components)
        return whiten(summed, lengths)
    raise ValueError(f"adv_estimator: unknown {estimator!r}")


def policy_loss(logp, old_logp, adv, mask, loss_type: str = "ppo", clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0):
    """Per-token policy loss (B, R) and a clipped indicator (B, R) (formulas: docs/algorithms.md). logp, old_logp,
    mask: (B, R); adv: (B,), or per token (B, R)."""
    a = adv.unsqueeze(-1) if adv.dim() == 1 else adv                                         # (B, 1) or (B, R)
    if loss_type == "ppo":
        ratio = torch.exp((logp - old_logp).clamp(-20, 20))                                   # (B, R)
        loss1, loss2 = -a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high)
        loss = torch.maximum(loss1, loss2)
        if clip_ratio_c:
            loss = torch.where(a < 0, torch.minimum(loss, -a * clip_ratio_c), loss)
        return loss, (loss2 > loss1).float()
    if loss_type == "gspo":
        seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)   # (B, 1)
        ratio = torch.exp((seq.detach() + logp - logp.detach()).clamp(max=10.0))             # (B, R)
        loss1, loss2 = -a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high)
        return torch.maximum(loss1, loss2), (loss2 > loss1).float()
    if loss_type == "cispo":
        ratio = torch.exp((logp - old_logp).clamp(-20, 20))                                   # (B, R)
        clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
        return -clipped_ratio.detach() * a * logp, (ratio != clipped_ratio).float()
    raise ValueError(f"loss_type: unknown {loss_type!r}")


def agg_loss(x, mask, mode: str, n_tok: float, n_seq: float, max_len: int) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: x, mask (b, R) -> scalar. n_tok / n_seq: the mini-batch's
    valid tokens / sequences over all ranks, so the shares sum to the exact loss."""
    if mode == "token-mean":
        return (x * mask).sum() / n_tok
    seq = (x * mask).sum(-1)                                           # (b,)
    if mode == "seq-mean-token-mean":
        seq = seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        seq = seq / max_len
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg: unknown {mode!r}")
    return seq.sum() / n_seq


def kl_penalty(logp, ref_logp, kind: str = "k3"):
    """Per-token estimate of KL(pi || ref): k1 d, abs |d|, k2 d^2 / 2, k3 exp(-d) + d - 1 (clamped as verl)."""
    d = logp - ref_logp                                                # (B, R)
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        x = (-d).clamp(-20, 20)
        return (torch.exp(x) - x - 1).clamp(-10, 10)
    raise ValueError(f"kl_type: unknown {kind!r}")


def is_weight(old_logp, rollout_logp, mask, level: str = "token", cap: float = 2.0, mode: str = "truncate"):
    """Truncated importance weight pi_old / pi_rollout (B, R), no gradient; 1 on rows without rollout log-probs
    (NaN: offline trajectories). sequence: one weight per row from the summed log-ratio."""
    log_ratio = torch.where(rollout_logp.isnan(), 0.0, old_logp - rollout_logp) * mask     # (B, R)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    w = torch.exp(log_ratio.clamp(-20, 20)).detach() * mask
    return w.clamp(max=cap) if mode == "truncate" else w * (w <= cap)


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO soft overlong punishment: 0 up to max_len - buffer tokens, then linear down to -1 at max_len."""
    return max(-1.0, min(0.0, (max_len - buffer - length) / buffer))


def split_batch(rollouts: list[Rollout], mini_batches: int, micro_batch_size: int,
                max_tokens: int = 0) -> list[list[list[int]]]:
    """Row indices of each micro-batch of each mini-batch. Mini-batches: contiguous, sizes differ by at most 1.
    Micro-batches: rows in order, at most micro_batch_size rows or (max_tokens > 0) max_tokens padded tokens, rows x
    (longest prompt + response). A group (its media encoded once per micro-batch) that does not fit in the current
    micro-batch starts a new one, unless it fits in none."""
    def fits(rows: list[int]) -> bool:
        if not max_tokens:
            return len(rows) <= micro_batch_size
        prompt = max(len(rollouts[j].prompt.prompt_ids) for j in rows)
        return len(rows) * (prompt + max(len(rollouts[j].response_ids) for j in rows)) <= max_tokens

    n = len(rollouts)
    bounds = [n * j // mini_batches for j in range(mini_batches + 1)]
    plan = []
    for lo, hi in zip(bounds, bounds[1:]):
        micro = [[]]
        for _, run in itertools.groupby(range(lo, hi), key=lambda j: id(rollouts[j].prompt)):
            group = list(run)  # consecutive rows sharing a prompt
            if micro[-1] and not fits(micro[-1] + group) and fits(group):
                micro.append([])
            for i in group:
                if micro[-1] and not fits(micro[-1] + [i]):
                    micro.append([])
                micro[-1].append(i)
        plan.append([rows for rows in micro if rows])
    return plan


def lr_at(step: int, cfg: Config) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------------------------------------------
# The loss on a micro-batch, and what it reads: old/ref log-probs, KL-in-reward, advantages over all ranks

def chunk_logp(hidden, weight, targets, temperature: float, banned: list[int]):
    """Log-prob of the targets and entropy at the sampling temperature: hidden (N, D), targets (N,) -> (N,), (N,)."""
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature             # (N, V)
    logits[:, banned] = -1e9  # the sampler masks vision tokens; finite so entropy has no 0 * inf
    lse = torch.logsumexp(logits, -1)                                                      # (N,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)         # stable form, as verl
    return logp, entropy


class ChunkedLogp(torch.autograd.Function):
    """chunk_logp over N positions, `chunk` at a time, holding no logits between forward and backward: backward
    recomputes each chunk's and adds its weight gradient into one buffer, so (chunk, V) logits live at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, banned: list[int], chunk: int):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.banned, ctx.chunk = temperature, banned, chunk
        parts = [chunk_logp(hidden[i:i + chunk], weight, targets[i:i + chunk], temperature, banned)
                 for i in range(0, max(1, len(targets)), chunk)]  # no targets: one empty chunk (an SP rank)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)
        for i in range(0, len(targets), ctx.chunk):
            h, y = hidden[i:i + ctx.chunk], targets[i:i + ctx.chunk]
            z = torch.nn.functional.linear(h, weight).float() / ctx.temperature                   # (n, V)
            z[:, ctx.banned] = -1e9
            p = torch.softmax(z, -1)
            gl, ge = grad_logp[i:i + ctx.chunk, None], grad_entropy[i:i + ctx.chunk, None]     # (n, 1)
            # d logp / dz = onehot(y) - p;  d entropy / dz = -p (z - sum_v p z)
            dz = -p * (gl + ge * (z - (p * z).sum(-1, keepdim=True)))
            dz.scatter_add_(1, y[:, None], gl)
            dz[:, ctx.banned] = 0.0
            dz = (dz / ctx.temperature).to(weight.dtype)
            grad_hidden[i:i + ctx.chunk] = dz @ weight
            grad_weight.addmm_(dz.T, h)
        return grad_hidden, grad_weight, None, None, None, None


def token_logp(model, batch: dict, temperature: float, banned: list[int], chunk: int = 0, layout=None):
    """Log-prob and entropy of each response token at the sampling temperature: (b, R), (b, R). Media are encoded once
    per distinct item (counted in batch["encodes"]) unless batch["vision"] holds them; `chunk` positions are projected
    at a time (0 = all). sp_size > 1 (layout): each SP rank computes its share (sp.py) and returns the whole."""
    rows, R = batch["mask"].shape
    vision = batch["vision"]
    if vision is None:
        vision = sp.encode_vision(model, batch["prompts"], batch["input_ids"].device, layout, batch["dummies"])
        batch["encodes"] += vision.encodes
    inputs, shard = sp.model_inputs(model, batch, vision, layout)
    # logits_to_keep=1: the model's own projection covers one position, ours below the responses; no KV cache
    out = model(**inputs, logits_to_keep=1, use_cache=False, output_hidden_states=True)
    a, b = shard.response_span(R)  # this rank's response tokens; token 0 is predicted at position length - R - 1
    first = shard.length - R - 1 - shard.start + a
    hidden = out.hidden_states[-1][:, first:first + b - a].flatten(0, 1)                  # (b r, D)
    weight = model.get_output_embeddings().weight  # FSDP2 keeps the root's parameters unsharded until backward
    targets = batch["response_ids"][:, a:b].flatten()                                      # (b r,)
    logp, entropy = ChunkedLogp.apply(hidden, weight, targets, temperature, banned, chunk or max(1, len(targets)))
    logp = logp + vision.zero  # a dummy's features, weight 0: the tower's backward runs on every rank alike
    return shard.gather(logp.view(rows, b - a), R), shard.gather(entropy.view(rows, b - a), R)


def collate(rollouts: list[Rollout], pad_id: int, tokenizer, device, dummies: dict | None = None) -> dict:
    """One micro-batch: left-padded prompts, right-padded responses, the rows' prompts (media) and M-RoPE grids; main
    fills in old/ref log-probs and advantages. dummies (data.dummy_prompts, FSDP2 on several ranks): the inputs
    token_logp's encode_vision runs through the tower for a modality no row has, weight 0 (never a decoder row)."""
    P = max(len(r.prompt.prompt_ids) for r in rollouts)
    R = max(max(len(r.response_ids) for r in rollouts), 1)
    B = len(rollouts)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R))
    rollout_logp = torch.full((B, R), float("nan"))  # NaN: no sampler log-probs (offline trajectory)
    for i, r in enumerate(rollouts):
        p, y = r.prompt.prompt_ids, r.response_ids
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(y)] = torch.tensor(y, dtype=torch.long)
        attn[i, P - len(p):P + len(y)] = 1
        mask[i, :len(y)] = 1
        if r.logp:
            rollout_logp[i, :len(y)] = torch.tensor(r.logp)
    prompts = [r.prompt for r in rollouts]
    grids = {k: torch.cat([p.mm[k] for p in prompts if k in p.mm]).to(device)
             for k in sorted({k for p in prompts for k in p.mm if not k.startswith("pixel_values")})}  # per row: M-RoPE
    input_ids = input_ids.to(device)
    return dict(input_ids=input_ids, attention_mask=attn.to(device), prompts=prompts, grids=grids, dummies=dummies,
                mm_token_type_ids=mm_token_types(input_ids, tokenizer), response_ids=input_ids[:, P:],
                mask=mask.to(device), rollout_logp=rollout_logp.to(device),                       # (b, R) each
                old_logp=None, ref_logp=None, adv=None,  # (b, R) each, set by main; old_logp None: on-policy
                vision=None, encodes=0)  # vision: encode_vision's features if computed once per step


def reference_logp(model, ref, b: dict, temperature: float, banned: list[int], chunk: int = 0,
                   layout=None) -> torch.Tensor:
    """The reference policy's log-probs (B, R): the frozen copy `ref`, or with LoRA (ref None) the policy with its
    adapters scaled to 0 (no second model). Not peft's disable_adapter: under FSDP2 its requires_grad toggle reaches
    only the root's unsharded copies, and root-held adapters (the vision merger) then silently stop training."""
    from peft.helpers import rescale_adapter_scale
    if ref is not None:
        return token_logp(ref, b, temperature, banned, chunk, layout)[0]
    with rescale_adapter_scale(model, 0.0):
        return token_logp(model, b, temperature, banned, chunk, layout)[0]


def micro_batches(rollouts: list[Rollout], cfg: Config, tok, device, dummies) -> list[list[dict]]:
    """The rollout batch as mini-batches of collated micro-batches (split_batch); "index": a micro-batch's rows.
    Every rank runs as many (FSDP): a rank that a token budget packed into fewer halves its largest ones."""
    plan = split_batch(rollouts, cfg.mini_batches, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
    counts = all_reduce([float(len(mini)) for mini in plan], op=dist.ReduceOp.MAX)
    minibatches = []
    for mini, count in zip(plan, counts):
        while len(mini) < count:
            big = max(mini, key=len)
            at = mini.index(big)
            mini[at:at + 1] = [big[:len(big) // 2], big[len(big) // 2:]]
        minibatches.append([dict(collate([rollouts[j] for j in rows], tok.pad_token_id, tok, device, dummies),
                                 index=rows) for rows in mini])
    return minibatches


def micro_loss(model, b: dict, cfg: Config, banned: list[int], n_tok: float, n_seq: float, layout=None):
    """This micro-batch's share of its mini-batch loss (backward it, summed over micro-batches and ranks it is
    the mini-batch loss) and its metric sums. b["old_logp"] None: on-policy, old = sg[logp] (ratio 1)."""
    logp, ent = token_logp(model, b, cfg.temperature, banned, cfg.logp_chunk, layout)                      # (b, R)
    mask = b["mask"]
    old = logp.detach() if b["old_logp"] is None else b["old_logp"]
    pg, clipped = policy_loss(logp, old, b["adv"], mask, loss_type=cfg.loss_type, clip_low=cfg.clip_low,
                              clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c)
    w = torch.ones_like(mask)  # the TIS weight, 1 when off
    if cfg.tis:
        w = is_weight(old, b["rollout_logp"], mask, level=cfg.tis, cap=cfg.tis_cap, mode=cfg.tis_mode)
    kl = torch.zeros_like(mask)
    if b["ref_logp"] is not None and not cfg.kl_in_reward:
        kl = kl_penalty(logp, b["ref_logp"], cfg.kl_type)
    bonus = ent if cfg.entropy_coef else ent.detach()  # no graph through the entropy unless it is in the loss
    norm = dict(mode=cfg.loss_agg, n_tok=n_tok, n_seq=n_seq, max_len=cfg.max_response_len)
    loss = agg_loss(pg * w, mask, **norm) - cfg.entropy_coef * agg_loss(bonus, mask, **norm) \
        + cfg.kl_coef * agg_loss(kl, mask, **norm)
    with torch.no_grad():
        has = ~b["rollout_logp"].isnan() & (mask > 0)  # health: sampler vs trainer log-probs on the same tokens
        d = torch.where(has, (old - b["rollout_logp"]).abs(), 0.0)
        metrics = {"loss": loss.item(), "clipfrac": (clipped * mask).sum().item(), "entropy": (ent * mask).sum().item(),
                   "kl": (kl * mask).sum().item(), "mismatch_sum": d.sum().item(), "mismatch_n": has.sum().item(),
                   "mismatch_max": d.max().item()}
        if cfg.tis:
            raw = is_weight(old, b["rollout_logp"], mask, level=cfg.tis, cap=float("inf"))
            metrics["tis_weight"] = w.sum().item()
            metrics["tis_clipped"] = ((w != raw) & has).sum().item()
    return loss, metrics


def global_counts(batches: list[dict]) -> tuple[float, float]:
    """Valid tokens and valid sequences of a mini-batch over all ranks: the loss normalizers."""
    return tuple(all_reduce([sum(b["mask"].sum().item() for b in batches),
                             sum((b["mask"].sum(-1) > 0).sum().item() for b in batches)]))


def kl_reward_to_go(minibatches: list[list[dict]], cfg: Config, layout: sp.Layout) -> torch.Tensor:
    """KL(old || ref) from each response token to the end (verl's apply_kl_penalty, gamma 1), for every data-parallel
    rank's rows in rank order (global_rows' order): (B_all, max_response_len)."""
    rows = []
    for b in itertools.chain(*minibatches):
        kl = kl_penalty(b["old_logp"], b["ref_logp"], cfg.kl_type) * b["mask"]                 # (b, R)
        rows.append(torch.nn.functional.pad(reward_to_go(kl), (0, cfg.max_response_len - kl.shape[1])).cpu())
    return torch.cat(gather(torch.cat(rows).double())[::layout.sp_size])


def batch_advantages(rows: dict, kl_to_go, cfg: Config) -> torch.Tensor:
    """Advantages (B_all, max_response_len) of the global batch (global_rows; whitening needs every rank's rows).
    GDPO's reward components: accuracy, format (+ overlong)."""
    keys = ["accuracy", "format"] + (["overlong"] if cfg.overlong_buffer else [])
    components = [torch.tensor([c[k] for c in rows["components"]], dtype=torch.float64) for k in keys]
    full = {k: torch.tensor(rows[k], dtype=torch.float64) for k in ("reward", "length", "baseline")}   # (B_all,)
    adv = advantages(reward=full["reward"], group_size=cfg.group_size, estimator=cfg.adv_estimator,
                     lengths=full["length"], baseline=full["baseline"], components=components, kl_to_go=kl_to_go,
                     eps=cfg.adv_eps)
    if adv.dim() == 1:  # one value per sequence: the same at every token
        adv = adv[:, None].expand(-1, cfg.max_response_len)
    return adv.float()


# ---------------------------------------------------------------------------------------------------
# Sampling and reward: groups are scored as they are generated (DAPO's dynamic sampling filters on the scores)

@dataclass
class Group:
    """One prompt's completions, their rewards (overall, and by component) and ReMax's baseline (else 0)."""
    rollouts: list[Rollout]
    rewards: list[float]
    components: list[dict]
    baseline: float = 0.0


def score(r: Rollout, cfg: Config) -> dict:
    """rewards.compute_reward's components and "overall", + DAPO's overlong penalty (a component: GDPO sees it)."""
    overall, comp = rewards.compute_reward(r.text, r.prompt.sample, cfg.w_acc, cfg.w_fmt, cfg.response_format)
    if cfg.overlong_buffer:
        comp["overlong"] = cfg.overlong_factor * overlong_penalty(len(r.response_ids), cfg.max_response_len,
                                                                  cfg.overlong_buffer)
        comp["overall"] = overall + comp["overlong"]
    return comp


def scored_group(rollouts: list[Rollout], cfg: Config, baseline: float = 0.0) -> Group:
    components = [score(r, cfg) for r in rollouts]
    return Group(rollouts, [c["overall"] for c in components], components, baseline)


def swap_offline(group: Group, cfg: Config, tok, eos_id: int) -> Group:
    """Mixed offline-online: the sample's offline_output replaces the LAST rollout of its group (always, or with
    mix_threshold > 0 only when the group's online accuracy is below it). Returns a new Group, or `group`."""
    p = group.rollouts[0].prompt
    text = p.sample.get("offline_output")
    online_acc = sum(c["accuracy"] for c in group.components) / len(group.components)
    if not cfg.mix_offline or not text or cfg.mix_threshold and online_acc >= cfg.mix_threshold:
        return group
    # its tokens + EOS (the policy learns to stop), truncated to the response budget like any sampled completion
    ids = (tok.encode(text, add_special_tokens=False) + [eos_id])[:cfg.max_response_len]
    return scored_group(group.rollouts[:-1] + [Rollout(p, ids, None, text, "offline")], cfg, group.baseline)


def has_spread(group: Group, metric: str) -> bool:
    """DAPO's filter: the group's metric (accuracy or the overall reward) differs between its rollouts."""
    values = group.rewards if metric == "reward" else [c[metric] for c in group.components]
    return len(values) == 1 or max(values) > min(values)


@dataclass
class Batch:
    """This rank's groups for one step, and what dynamic sampling did to get them."""
    groups: list[Group]
    skips: list[dict]     # samples that failed preparation (skip_invalid), replaced from the stream
    rounds: int = 1       # generation rounds
    dropped: int = 0      # groups dropped by dynamic sampling
    refilled: int = 0     # dropped groups taken back to fill the batch after max_gen_rounds


def sample_batch(engine, stream: data.Stream, samples: list, prep, cfg: Config, step: int, rank: int, world: int,
                 tok, eos_id: int, layout: sp.Layout) -> Batch:
    """This rank's prompts_per_step / dp_size scored Groups. Per round: the TP group generates its share of the next
    prompts, SP ranks exchange theirs, ReMax scores one extra greedy response as the baseline; DAPO dynamic sampling
    drops groups without spread and repeats until all ranks are full or max_gen_rounds, then refills (counted)."""
    n, need, kept, dropped, skips = cfg.group_size, cfg.prompts_per_step // layout.dp_size, [], [], []
    for gen_round in range(max(1, cfg.max_gen_rounds)):
        prompts, new_skips = data.next_valid(stream, samples, prep, cfg, rank=rank, world=world)
        skips += new_skips
        seed = request_seed(cfg.seed, step, gen_round)
        share, start, k = data.tp_share(prompts, rank, world, cfg.rollout_tp)
        rollouts = engine.generate(share, n, cfg.temperature, cfg.max_response_len, seed=seed)[start * n:][:k * n]
        baselines = [0.0] * k
        if cfg.adv_estimator == "remax":
            greedy = engine.generate(share, 1, 0.0, cfg.max_response_len, seed=seed)[start:start + k]
            baselines = [score(r, cfg)["overall"] for r in greedy]
        if layout.sp_size > 1:
            group_prompts = data.tp_share(prompts, rank, world, layout.sp_size)[0]
            rollouts, baselines = sp.group_rollouts(rollouts, baselines, group_prompts, n, layout)
        for i, baseline in enumerate(baselines):
            group = swap_offline(scored_group(rollouts[i * n:(i + 1) * n], cfg, baseline), cfg, tok, eos_id)
            if not cfg.dynamic_sampling or has_spread(group, cfg.dyn_filter_metric):
                kept.append(group)
            else:
                dropped.append(group)
        if not all_reduce([float(len(kept) < need)])[0]:  # all ranks take the same number of rounds
            break
    refilled = max(0, need - len(kept))
    return Batch(groups=(kept + dropped[:refilled])[:need], skips=skips, rounds=gen_round + 1, dropped=len(dropped),
                 refilled=refilled)


def global_rows(groups: list[Group], layout: sp.Layout) -> tuple[dict, int]:
    """Per-row values of the global batch, every data-parallel rank's rows in rank order (an SP group's ranks hold
    the same rows: one copy), and where this rank's rows start. One gather: advantages and metrics read them."""
    rollouts = [r for g in groups for r in g.rollouts]
    mine = {"reward": [x for g in groups for x in g.rewards], "components": [c for g in groups for c in g.components],
            "baseline": [g.baseline for g in groups for _ in g.rollouts], "finish": [r.finish for r in rollouts],
            "length": [len(r.response_ids) for r in rollouts], "id": [r.prompt.sample["id"] for r in rollouts],
            "type": [rewards.canonical_type(r.prompt.sample["problem_type"]) for r in rollouts]}
    parts = gather(mine)[::layout.sp_size]
    start = sum(len(p["reward"]) for p in parts[:layout.dp_rank])
    return {k: [x for p in parts for x in p[k]] for k in mine}, start


# ---------------------------------------------------------------------------------------------------
def main(cfg: Config):
    rank, world, device = init_dist(cfg.dist_timeout, cfg.offload)
    check_config(cfg, world)
    layout = sp.make_layout(cfg.sp_size)  # dp x sp: the ranks of an SP group train the same rows
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    tok = processor.tokenizer
    template = open(cfg.prompt_template).read() if cfg.prompt_template else None
    skipped: list = []  # every skip report of the run, written to out_dir/skipped.jsonl
    # the model's special tokens in any text field (offline_output: <|image_pad|> is banned, <|im_end|> ends a turn)
    specials = data.SPECIAL_TOKENS + tuple(t.content for t in tok.added_tokens_decoder.values() if t.special)
    load = functools.partial(data.load_samples, skip_invalid=cfg.skip_invalid, skipped=skipped, special_tokens=specials)
    train_samples = load(cfg.train_data)
    if not train_samples:
        raise data.DataError(f"{cfg.train_data}: no valid training sample ({len(skipped)} skipped)")
    if template:
        data.check_template(template, train_samples[0])
    val_samples = load(cfg.val_data)[:cfg.eval_max_samples] if cfg.val_data else []
    if cfg.dry_run:
        return dry_run(cfg, processor, template, {"train": train_samples, "val": val_samples}, skipped)
    model = load_model(cfg, device)
    ref = load_model(cfg, device).eval().requires_grad_(False) if cfg.kl_coef > 0 and not cfg.lora_rank else None
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    ckpt_path = ckpt.find(cfg.out_dir, cfg.resume)
    state = ckpt.load(ckpt_path, model, opt) if ckpt_path else {}  # before the engine is built: it gets these weights
    eos_ids = model.generation_config.eos_token_id
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    banned = vision_token_ids(tok)
    dummies = data.dummy_prompts(processor) if world > 1 else None  # FSDP: same modules in every forward
    if cfg.rollout == "vllm":
        media = [(len(s.get("images", [])), len(s.get("videos", []))) for s in train_samples + val_samples]
        # the trainer's compute dtype: vLLM's "auto" would downcast an fp32 checkpoint to bf16 on CPU
        engine = VLLMEngine(cfg.model, tok, tp=cfg.rollout_tp, max_model_len=cfg.max_model_len,
                            dtype="bfloat16" if device.type == "cuda" else "float32",
                            gpu_memory_utilization=cfg.gpu_memory_utilization, sleep=cfg.vllm_sleep, seed=cfg.seed,
                            trust_remote_code=cfg.trust_remote_code, max_images=max([i for i, _ in media] + [1]),
                            max_videos=max([v for _, v in media] + [1]))
        engine.sync(model)  # from the first step on, the engine and the trainer hold the same weights
    else:
        engine = HFEngine(model, tok, eos_ids, dummies)
    ckpt.catch_stop_signals(catch=False)  # after the engine (ours must be the handlers); startup: a signal ends it
    stats = {"cache_hit": 0, "cache_miss": 0, "cache_corrupt": 0, "decode": 0, "decode_s": 0.0}
    fmt = dict(template=template, response_format=cfg.response_format)
    prep = functools.partial(data.prepare, processor=processor, cfg=cfg, stats=stats, **fmt)
    val_prep = functools.partial(data.prepare, processor=processor, cfg=val_config(cfg), stats=stats, **fmt)
    val_prompts, skips = data.prep_all(val_prep, val_samples, cfg)
    skipped = state.get("skipped", skipped + skips)  # a resumed run: the saved report already holds the load/val skips
    logger = start_logger(cfg, state.get("wandb_id"), rank)
    acc_before = state["acc_before"] if state else float("nan")
    if state:
        print0(f"resumed from {ckpt_path} (step {state['step']})")
    elif val_prompts:
        acc_before = evaluate.accuracy(engine, val_prompts, cfg, rank=rank, world=world)
    print0(f"step 0 | held-out accuracy {acc_before:.3f} | {len(train_samples)} train, {len(val_prompts)} val, "
           f"{len(skipped)} skipped | world {world} | rollout {cfg.rollout} tp={cfg.rollout_tp}")
    # the same order on every rank; the position (epoch, cursor) is saved in every checkpoint
    stream = data.Stream(len(train_samples), cfg.seed, **state.get("data", {}))
    need_old = cfg.ppo_epochs > 1 or cfg.mini_batches > 1 or cfg.kl_in_reward
    if rank == 0:
        evaluate.write_jsonl(os.path.join(cfg.out_dir, "skipped.jsonl"), skipped)  # atomic; training-time skips later
        for name in ("metrics.jsonl", "samples.jsonl"):  # else rerunning into an out_dir would mix two runs' curves
            trim_rows(os.path.join(cfg.out_dir, name), state.get("step", 0))
    acc_after = state.get("acc_after", float("nan"))  # after the last step (evaluated inside the loop: it is logged)
    if state.get("step", 0) >= cfg.max_steps:
        print0(f"{ckpt_path} is at step {state['step']}: max_steps {cfg.max_steps} reached, nothing to train")
    t_start = time.time()
    signals = ckpt.catch_stop_signals()  # inside a step: the first signal checkpoints at the step boundary
    for step in range(state.get("step", 0) + 1, cfg.max_steps + 1):
        t0 = time.time()
        stats_before, n_skipped = dict(stats), len(skipped)
        # ------------------------------------------------------------------ sample, reward (+ DAPO dynamic sampling)
        batch = sample_batch(engine, stream, train_samples, prep, cfg, step=step, rank=rank, world=world, tok=tok,
                             eos_id=eos_ids[0], layout=layout)  # groups are scored as they are generated
        skipped += batch.skips
        engine.sleep()
        t_gen = time.time() - t0
        rollouts = [r for g in batch.groups for r in g.rollouts]
        rows, start = global_rows(batch.groups, layout)  # every rank's rows: advantages and metrics
        ids = rows["id"][::cfg.group_size]
        # ------------------------------------------------------------------ old / ref log-probs (no grad, once)
        t1 = time.time()
        minibatches = micro_batches(rollouts, cfg, tok, device, dummies)
        m = {"kl": 0.0, "vision_encodes": 0}  # this step's metric sums over micro-batches
        with torch.no_grad():
            frozen = None  # freeze_vision: every prompt's features, once (same tower, so the reference's too)
            if cfg.freeze_vision:
                frozen = sp.encode_vision(model, [r.prompt for r in rollouts], device, layout, dummies)
                m["vision_encodes"] = frozen.encodes
            for b in itertools.chain(*minibatches):
                b["vision"] = frozen
                if need_old:
                    b["old_logp"] = token_logp(model, b, cfg.temperature, banned, cfg.logp_chunk, layout)[0]
                if cfg.kl_coef > 0:
                    b["ref_logp"] = reference_logp(model, ref, b, cfg.temperature, banned, cfg.logp_chunk, layout)
        kl_to_go = None
        if cfg.kl_in_reward:  # verl apply_kl_penalty: on old (rollout-time) log-probs (check_config: kl_coef > 0)
            kl_to_go = kl_reward_to_go(minibatches, cfg, layout)                                  # (B_all, R)
            m["kl"] = kl_to_go[start:start + len(rollouts), 0].sum().item()  # this rank's rows
            kl_to_go = cfg.kl_coef * kl_to_go
        # ------------------------------------------------------------------ advantage
        adv_all = batch_advantages(rows, kl_to_go, cfg)                                   # (B_all, max_response_len)
        adv = adv_all[start:start + len(rollouts)].to(device)                              # this rank's rows
        for b in itertools.chain(*minibatches):
            b["adv"] = adv[b["index"], :b["mask"].shape[1]]
        # ------------------------------------------------------------------ loss and step
        for group_param in opt.param_groups:
            group_param["lr"] = lr_at(step - 1, cfg)
        gnorms = []  # grad_norm logged: the mean over this step's optimizer steps
        model.train()  # only lora_dropout acts in train mode (the Qwen-VL models have no other dropout)
        for epoch in range(cfg.ppo_epochs):
            for mini in minibatches:
                n_tok_mb, n_seq_mb = (n / cfg.sp_size for n in global_counts(mini))  # SP groups: each row once
                loss_sum = 0.0
                for b in mini:
                    loss, metrics = micro_loss(model, b, cfg, banned, n_tok=n_tok_mb, n_seq=n_seq_mb, layout=layout)
                    (loss * world).backward()  # FSDP averages gradients over ranks: x world makes it their sum
                    loss_sum += metrics["loss"]
                    if epoch == 0:  # the first pass's metrics, summed (mismatch_max: the maximum)
                        for k, v in metrics.items():
                            m[k] = max(m.get(k, 0.0), v) if k == "mismatch_max" else m.get(k, 0.0) + v
                gnorm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
                gnorms.append(float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm))
                if not math.isfinite(all_reduce([loss_sum + gnorms[-1]])[0]):  # any rank: stop before the step
                    raise FloatingPointError(f"step {step}: the loss ({loss_sum} on rank {rank}) or the grad norm "
                                             f"({gnorms[-1]}) is not finite; samples {ids}: stopped before the update")
                opt.step()
                opt.zero_grad(set_to_none=True)
        model.eval()
        m["loss"] /= len(minibatches)
        m["vision_encodes"] += sum(b["encodes"] for b in itertools.chain(*minibatches))

        m.update(dyn_rounds=batch.rounds, dyn_dropped=batch.dropped, dyn_refilled=batch.refilled)
        # ------------------------------------------------------------------ sync
        t2 = time.time()
        engine.sync(model)
        times = dict(gen=t_gen, train=t2 - t1, sync=time.time() - t2, step=time.time() - t0)
        # ------------------------------------------------------------------ log
        parts = gather({"m": m, "stats": {k: stats[k] - stats_before[k] for k in stats},
                        "samples": sample_rows(batch.groups, adv, step, cfg)})
        evaluated = val_prompts and (step == cfg.max_steps or cfg.eval_every and step % cfg.eval_every == 0)
        if evaluated:
            acc_after = evaluate.accuracy(engine, val_prompts, cfg, rank=rank, world=world, step=step)  # the result
        if rank == 0:
            row = step_metrics(rows, adv_all, parts, step, cfg, gnorm=mean(gnorms), lr=lr_at(step - 1, cfg),
                               times=times)
            row.update({"data/skipped": len(skipped), "data/skipped_step": len(skipped) - n_skipped, "data/ids": ids})
            if evaluated:
                row["eval/accuracy"] = acc_after
            if len(skipped) > n_skipped:
                evaluate.write_jsonl(os.path.join(cfg.out_dir, "skipped.jsonl"), skipped)
            per_step = (time.time() - t_start) / (step - state.get("step", 0))
            eta = datetime.timedelta(seconds=round(per_step * (cfg.max_steps - step)))
            shown = [f"{k} {v:.4g}" for k, v in row.items() if k in LOG_KEYS]
            print0(" | ".join([f"step {step}/{cfg.max_steps}"] + shown + [f"{per_step:.3g} s/step | ETA {eta}"]))
            write_samples([x for p in parts[::cfg.sp_size] for x in p["samples"]][:cfg.log_samples], cfg, logger, step)
            with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            logger.log(row, step=step)
        # ------------------------------------------------------------------ checkpoint / preemption
        stop = ckpt.any_rank(bool(signals))
        if stop or (cfg.save_every and step % cfg.save_every == 0):
            meta = dict(step=step, data={"epoch": stream.epoch, "cursor": stream.cursor}, config=asdict(cfg),
                        wandb_id=logger.id, acc_before=acc_before, acc_after=acc_after, skipped=skipped)
            ckpt.save(cfg.out_dir, step, model, opt, processor, meta=meta, keep_last=cfg.keep_last, rank=rank)
        if stop:
            print0(f"step {step}: stop signal {signals}: checkpoint saved, exiting")
            return acc_before, float("nan")
    ckpt.catch_stop_signals(catch=False)  # the end of the run: no step to finish
    if rank == 0 and state.get("step", 0) < cfg.max_steps:  # this process trained a step
        rows = plot_runs.curve_rows(os.path.join(cfg.out_dir, "metrics.jsonl"), acc_before)
        curves = [("reward/mean", "-", "train reward"), ("reward/accuracy", "-", "train accuracy"),
                  ("eval/accuracy", "o-", "held-out accuracy (greedy)")]
        lines = [([r["step"] for r in rows if key in r], [r[key] for r in rows if key in r], style, label)
                 for key, style, label in curves]
        plot_runs.plot(lines, os.path.join(cfg.out_dir, "curve.png"))
        with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
            json.dump({"acc_before": acc_before, "acc_after": acc_after, "config": asdict(cfg)}, f, indent=1)
    if cfg.save:
        save_checkpoint(model, processor, os.path.join(cfg.out_dir, "final"), rank)
    logger.finish()
    if isinstance(engine, VLLMEngine):
        engine.llm.llm_engine.engine_core.shutdown()  # now, not in its __del__ at interpreter exit (a traceback)
    print0(f"held-out accuracy: before {acc_before:.2f} after {acc_after:.2f}")
    ckpt.barrier()
    return acc_before, acc_after


# ---------------------------------------------------------------------------------------------------
# Metrics and logging

class NoLogger:
    """Stands in for a wandb run when wandb is off."""
    id = None

    def log(self, row: dict, step: int):
        pass

    def finish(self):
        pass


def trim_rows(path: str, last_step: int):
    """Keep a JSONL log's rows up to last_step: a fresh run keeps none of an earlier run's, a resumed one drops the
    steps its checkpoint lacks (a crashed run had logged them; they are trained again). Dropped rows are reported."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = f.readlines()
    kept = [r for r in rows if r.endswith("\n") and json.loads(r)["step"] <= last_step]  # no newline: torn by a crash
    if len(kept) < len(rows):
        print(f"{path}: {len(rows) - len(kept)} rows past step {last_step} (an earlier run's) removed")
        evaluate.write_text(path, "".join(kept))


def sample_rows(groups: list[Group], adv: torch.Tensor, step: int, cfg: Config) -> list[dict]:
    """What the model writes, every log_every steps: the first completion of each of this rank's first log_samples
    groups, its reward components and advantage (at its first token: per-token estimators vary along it)."""
    if not cfg.log_every or step % cfg.log_every:
        return []
    return [{"step": step, "id": g.rollouts[0].prompt.sample["id"], "response": g.rollouts[0].text,
             "finish": g.rollouts[0].finish, "reward": g.components[0], "advantage": adv[i * cfg.group_size, 0].item()}
            for i, g in enumerate(groups[:cfg.log_samples])]


def write_samples(shown: list[dict], cfg: Config, logger, step: int):
    """Append sample_rows' rows to out_dir/samples.jsonl; with wandb on, log them as a table too."""
    if not shown:
        return
    with open(os.path.join(cfg.out_dir, "samples.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in shown)
    if cfg.wandb_project:
        import wandb
        cells = [[json.dumps(v) if isinstance(v, dict) else v for v in r.values()] for r in shown]
        logger.log({"samples": wandb.Table(columns=list(shown[0]), data=cells)}, step=step)


def start_logger(cfg: Config, run_id: str | None, rank: int):
    """Rank 0's wandb run (resumed by id), online, offline or disabled as `wandb login` and WANDB_MODE say."""
    if rank or not cfg.wandb_project:
        return NoLogger()
    import wandb
    return wandb.init(project=cfg.wandb_project, config=asdict(cfg), dir=cfg.out_dir, id=run_id, resume="allow")


LOG_KEYS = ("reward/mean", "reward/accuracy", "reward/format", "reward/parse_fail", "len/mean", "loss", "clipfrac",
            "entropy", "grad_norm", "mismatch/mean", "eval/accuracy", "time/step", "time/gen", "time/train", "tokens/s")


def mean(xs: list) -> float:
    return sum(xs) / max(1, len(xs))


def step_metrics(rows: dict, adv: torch.Tensor, parts: list[dict], step: int, cfg: Config, gnorm: float, lr: float,
                 times: dict) -> dict:
    """Global metrics: exact means over every row (global_rows, adv (B_all, R)) and every rank's sums (parts), an SP
    group's once, except the work each rank does (vision encodes: its share of the frames; cache counters)."""
    msum = {k: sum(p["m"][k] for p in parts[::cfg.sp_size]) for k in parts[0]["m"]}
    rew, comp, types, n_tok = rows["reward"], rows["components"], rows["type"], sum(rows["length"])
    off = [f == "offline" for f in rows["finish"]]
    row = {"step": step, "reward/mean": mean(rew), "lr": lr, "grad_norm": gnorm, "loss": msum["loss"],
           "clipfrac": msum["clipfrac"] / n_tok, "entropy": msum["entropy"] / n_tok, "kl": msum["kl"] / n_tok,
           "mismatch/mean": msum["mismatch_sum"] / max(1.0, msum["mismatch_n"]),
           "mismatch/max": max(p["m"]["mismatch_max"] for p in parts), "len/mean": mean(rows["length"]),
           "len/truncated": mean([f == "length" for f in rows["finish"]]), "tokens/s": n_tok / times["step"],
           "vision/encodes": sum(p["m"]["vision_encodes"] for p in parts), "dyn/rounds": parts[0]["m"]["dyn_rounds"],
           "dyn/dropped": msum["dyn_dropped"], "dyn/refilled": msum["dyn_refilled"]}
    for key in [k for k in ("accuracy", "format", "parse_fail", "overlong") if k in comp[0]]:
        row[f"reward/{key}"] = mean([c[key] for c in comp])
        for t in sorted(set(types)):
            row[f"reward/{key}/{t}"] = mean([c[key] for c, ty in zip(comp, types) if ty == t])
    groups = [rew[i:i + cfg.group_size] for i in range(0, len(rew), cfg.group_size)]
    row["zero_std_groups"] = mean([float(max(x) == min(x)) for x in groups])
    if cfg.tis:
        row.update({"tis/weight": msum["tis_weight"] / n_tok, "tis/clipped": msum["tis_clipped"] / n_tok})
    if cfg.adv_estimator == "remax":
        row["reward/greedy"] = mean(rows["baseline"])
    if any(off):
        row["offline/share"] = mean(off)
        row["offline/reward"] = mean([r for r, o in zip(rew, off) if o])
        row["offline/adv"] = mean([a for a, o in zip(adv[:, 0].tolist(), off) if o])
        row["online/reward"] = mean([r for r, o in zip(rew, off) if not o])
    row.update({f"cache/{k}": sum(p["stats"][k] for p in parts) for k in parts[0]["stats"]})
    row.update({f"time/{k}": v for k, v in times.items()})
    return row


# ---------------------------------------------------------------------------------------------------
# Setup helpers

def load_model(cfg: Config, device):
    """HF model (LoRA: a peft model, the base frozen), FSDP2-sharded per decoder layer and vision block, fp32 master
    weights, bf16 compute on GPU; activation checkpointing (module hooks, non-reentrant) goes on before FSDP."""
    from torch.distributed._composable import checkpoint as checkpoint_module
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from transformers import AutoModelForImageTextToText
    cuda = device.type == "cuda"
    attn = "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation=attn,
                                                        trust_remote_code=cfg.trust_remote_code).to(device)
    visual = model.model.visual  # taken before peft wraps the model (PeftModel.model is another object)
    visual.requires_grad_(not cfg.freeze_vision)
    blocks = list(model.model.language_model.layers) + list(visual.blocks)
    if cfg.gradient_checkpointing:
        for block in blocks:
            checkpoint_module(block)
    if cfg.sp_size > 1:
        sp.use_ulysses(model)
    if cfg.lora_rank:  # before fully_shard, which then shards the frozen base and the adapters alike
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                                 lora_dropout=cfg.lora_dropout, target_modules=cfg.lora_targets))
    # one CPU process gains nothing from FSDP2 (no mixed precision on CPU), and a process group can exist without
    # torchrun (vLLM's in-process engine creates one): shard on several ranks, or on a GPU for bf16 compute
    if dist.is_initialized() and (dist.get_world_size() > 1 or cuda):
        bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mp = MixedPrecisionPolicy(**bf16) if cuda else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy() if cfg.offload else OffloadPolicy()  # CPU: the shards and the AdamW step
        for module in blocks + [visual, model]:  # each layer/block its own all-gather unit; the root (last) the rest
            fully_shard(module, mp_policy=mp, offload_policy=offload)
        # token_logp calls the vision tower (its own unit) before the root's forward: the root is set up first
        model._get_fsdp_state()._lazy_init()
    return model


if __name__ == "__main__":
    main(load_config())

"""train.py: GRPO-family RL for video (and image) VLMs, in one file you read top to bottom.

    python train.py --config configs/tiny_cpu.yaml                           # one process
    torchrun --nproc_per_node=2 train.py --config configs/tiny_cpu.yaml configs/dapo.yaml  # recipe
    torchrun --nproc_per_node=8 train.py --config configs/qwen2_5_vl_7b.yaml  # 8 GPUs (nccl)

Every rank runs the same loop (SPMD, no controller): FSDP2 shards the policy, a vLLM engine lives in
the same process (rollout.py) and gets the new weights after every optimizer step. A step, as main's
banners say: sample and score groups (DAPO dynamic sampling), old/ref log-probs, advantages on the
global batch, ppo_epochs x mini_batches optimizer steps, weight sync. The math follows verl 0.9.1;
docs/algorithms.md gives every formula and each deliberate deviation.
"""

import contextlib
import datetime
import functools
import hashlib
import importlib.util
import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Literal

import torch
import torch.distributed as dist

import ckpt
import common
import data
import rewards
import sp
from cache import Media
from common import (
    MAY_CHANGE_ON_RESUME,
    NOT_NEGATIVE,
    POSITIVE,
    UserError,
    all_reduce,
    any_rank,
    barrier,
    catch_stop_signals,
    fact,
    gather,
    init_dist,
    print0,
)
from rollout import (
    HFEngine,
    Rollout,
    VLLMEngine,
    engine_errors,
    eos_token_ids,
    linear_attention,
    model_spec,
    request_seed,
    vision_token_ids,
)


# Every setting of a run. Media (cache.py, shared with evaluate.py) declares the frame and image settings:
# video_fps, video_min/max_frames, video_min/max/total_pixels, max_decode_pixels, image_min/max_pixels,
# video_source, cache_dir. Facts beside a field (common.py): POSITIVE / NOT_NEGATIVE (check_config),
# MAY_CHANGE_ON_RESUME (check_files). (No docstring: tyro would print it atop --help.)
@dataclass
class Config(rewards.JudgeSettings, Media):
    config: tuple[str, ...] = fact((), MAY_CHANGE_ON_RESUME)
    """YAML files setting the defaults, each over the ones before (bad keys fail); flags win"""
    dry_run: bool = fact(False, MAY_CHANGE_ON_RESUME)
    """check config and data, print the resolved config, data counts, longest prompt; then exit"""
    world: int = fact(0, NOT_NEGATIVE, MAY_CHANGE_ON_RESUME)
    """--dry-run: check the recipe for this many ranks, without their GPUs (0 = this launch's)"""
    # --- model and data (`scripts/cache_frames.py --config` reads these from the same YAML)
    model: str = ".cache/models/tiny-qwen2_5_vl"
    """HF model folder (Qwen2-VL, Qwen2.5-VL or Qwen3-VL)."""
    trust_remote_code: bool = False
    """let transformers/vLLM run code shipped with the checkpoint (off: only trusted, built-in models)"""
    train_data: str = ".cache/data/color/train.jsonl"
    """training samples (JSONL or JSON array; schema in data.py)"""
    val_data: str = ".cache/data/color/val.jsonl"
    """held-out samples for greedy accuracy ('' to skip evaluation)"""
    val_video_fps: float = 0.0
    """held-out frame budget (Config.media): fps (0 = the training value); likewise the val_* fields below"""
    val_video_max_frames: int = 0
    """validation: max frames per video (0 = video_max_frames)"""
    val_video_max_pixels: int = 0
    """validation: max pixels per frame (0 = video_max_pixels)"""
    val_video_total_pixels: int = 0
    """validation: pixel budget over a video's frames (0 = video_total_pixels)"""
    val_image_max_pixels: int = 0
    """validation: max pixels per image (0 = image_max_pixels)"""
    # --- the run
    out_dir: str = fact("runs/tiny", MAY_CHANGE_ON_RESUME)
    """run folder: metrics.jsonl, curve.png, skipped.jsonl, checkpoints"""
    skip_invalid: bool = False
    """skip (count, log, report) invalid samples instead of stopping at the first one"""
    max_consecutive_invalid: int = 1000
    """skip_invalid: more invalid samples in a row fail the run (the data may hold none valid)"""
    prompt_template: str = ""
    """path to a Jinja2 template for the user prompt ('' = per-problem-type defaults in data.py)"""
    max_prompt_len: int = fact(4096, POSITIVE)
    """prompts longer than this (in tokens, vision included) are an error, never truncated"""
    # --- rollout
    rollout: Literal["vllm", "hf"] = "vllm"
    """sampler: vllm (colocated engine) | hf (transformers generate on the training model)"""
    rollout_tp: int = fact(1, POSITIVE)
    """vLLM tensor parallel size: ranks per engine (1 = an engine per rank); with sp_size > 1 it divides sp_size"""
    group_size: int = fact(8, POSITIVE)
    """completions per prompt (n)"""
    prompts_per_step: int = fact(8, POSITIVE)
    """prompts per optimizer step over all ranks (divisible by world / sp_size)"""
    temperature: float = 1.0
    """sampling temperature; the trainer's log-probs use the same one"""
    max_response_len: int = fact(64, POSITIVE)
    """max new tokens per completion"""
    max_model_len: int = 4096
    """vLLM context length"""
    gpu_memory_utilization: float = fact(0.4, POSITIVE)
    """vLLM's share of GPU memory (colocated with training)"""
    vllm_sleep: bool = True
    """sleep vLLM during the train phase where the platform supports it (CUDA)"""
    mix_offline: bool = True
    """a sample's offline_output replaces the last rollout of its group"""
    mix_threshold: float = fact(0.0, NOT_NEGATIVE)
    """swap only if the group's online accuracy is below this (0 = always); logged as offline/*"""
    # --- reward
    w_acc: float = fact(0.9, NOT_NEGATIVE)
    """weight of the accuracy reward"""
    w_fmt: float = fact(0.1, NOT_NEGATIVE)
    """weight of the format reward"""
    response_format: Literal["answer", "think_answer"] = "answer"
    """prompts ask for, the format reward checks: <answer>..</answer>, or <think>..</think> first"""
    # --- algorithm (verl 0.9.1 definitions; configs/<algorithm>.yaml name the combinations)
    adv_estimator: Literal[
        "grpo",
        "drgrpo",
        "rloo",
        "reinforce++",
        "reinforce++-baseline",
        "remax",
        "gdpo",
        "grpo_passk",
        "gae",
    ] = "grpo"
    """grpo | drgrpo (no std division) | rloo | reinforce++ | reinforce++-baseline | remax | gdpo |
    grpo_passk (pass@k, k = group_size: only the group's best response, (r_max - r_2nd) / (std + eps)) |
    gae (PPO with a critic)"""
    adv_eps: float = fact(1e-6, NOT_NEGATIVE)
    """epsilon in (r - mean) / (std + eps)"""
    loss_type: Literal["ppo", "gspo", "cispo", "sft"] = "ppo"
    """ppo (PPO-clip, dual-clip) | gspo (sequence-level ratio) | cispo (clipped IS weight) |
    sft (supervised cold start: NLL of each sample's offline_output, prompt masked; no rollouts)"""
    clip_low: float = fact(0.2, NOT_NEGATIVE)
    """clip: ratio >= 1 - clip_low"""
    clip_high: float = fact(0.2, NOT_NEGATIVE)
    """clip: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)"""
    clip_ratio_c: float = 3.0
    """dual-clip (ppo): a token with A < 0 loses at most clip_ratio_c * |A|; > 1, or 0 = off"""
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """how token losses become the batch loss (seq-mean-token-sum-norm: Dr.GRPO)"""
    kl_coef: float = fact(0.0, NOT_NEGATIVE)
    """KL-to-reference coefficient (0 = no reference model is loaded)"""
    kl_type: Literal["k1", "abs", "k2", "k3"] = "k3"
    """KL estimator: k1 | abs | k2 | k3 (low_var_kl, clamped)"""
    kl_in_reward: bool = False
    """kl_coef * KL(old || ref) off the return, not a KL loss (reinforce++, remax: per token)"""
    gamma: float = 1.0
    """gae: discount of the per-token rewards"""
    lam: float = 1.0
    """gae: GAE's lambda (1: Monte-Carlo returns, 0: one-step TD)"""
    critic_lr: float = fact(1e-5, POSITIVE)
    """gae: the critic's learning rate (AdamW, constant)"""
    cliprange_value: float = fact(0.5, POSITIVE)
    """gae: the value loss clips new values to the old ones +- this"""
    critic_warmup: int = fact(0, NOT_NEGATIVE)
    """gae: the first critic_warmup steps train the critic only (no policy step)"""
    entropy_coef: float = fact(0.0, NOT_NEGATIVE)
    """entropy bonus: loss -= entropy_coef * aggregated entropy (entropy is logged either way)"""
    router_aux_loss: bool = False
    """MoE models: add the routers' load-balancing loss (transformers' output_router_logits; its
    load_balancing_loss_func over every sparse layer), logged as router/aux. Off by default in RL:
    vLLM samples with its own routing, and balancing moves the trainer's routing from it"""
    router_aux_loss_coef: float = fact(0.001, NOT_NEGATIVE)
    """its weight (transformers' router_aux_loss_coef; the published MoE configs' 0.001)"""
    tis: Literal["", "token", "sequence"] = ""
    """truncated importance sampling pi_old / pi_rollout: '' (off) | token | sequence"""
    tis_cap: float = fact(2.0, POSITIVE)
    """upper bound of that importance weight"""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """truncate (w = min(w, cap)) | mask (w = 0 where w > cap)"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose dyn_filter_metric is the same for all rollouts, sample more"""
    dyn_filter_metric: Literal["accuracy", "reward"] = "accuracy"
    """dynamic sampling filters on: accuracy (DAPO, verl) | reward (overall, penalties included)"""
    max_gen_rounds: int = fact(4, POSITIVE)
    """dynamic sampling: most generation rounds per step (then dropped groups fill the batch)"""
    overlong_buffer: float = fact(0.0, NOT_NEGATIVE)
    """DAPO soft overlong penalty: 0 to -overlong_factor, linear over the last overlong_buffer x max_response_len
    tokens (a fraction, so a recipe fits any response length; DAPO: 4096 of 20480 = 0.2; 0 = off)"""
    overlong_factor: float = 1.0
    """size of the overlong penalty at max_response_len"""
    ppo_epochs: int = fact(1, POSITIVE)
    """passes over each rollout batch"""
    mini_batches: int = fact(1, POSITIVE)
    """optimizer steps per pass: the rollout batch is split into this many mini-batches"""
    micro_batch_size: int = fact(16, POSITIVE)
    """sequences per forward/backward on each rank"""
    # --- memory
    freeze_vision: bool = False
    """no gradient into the vision tower: its features, once per step, serve all passes"""
    vllm_embeds: bool = False
    """freeze_vision with rollout vllm: vLLM generates from the trainer's features (one encode per
    prompt and step, which logp_pass reuses) and loads no vision tower (Qwen3-VL: loaded, never
    run); rollout_tp > 1: a TP group gathers its ranks' features; sp_size > 1: an SP group encodes
    its runs before generation and gathers them"""
    feature_cache_dir: str = fact("", MAY_CHANGE_ON_RESUME)
    """the reference tower's features (kl_coef, a trained tower) also on disk, per sample and SP run,
    keyed by the media files and settings and the reference's weights: a later run reads them
    instead of encoding ('' = in host memory alone, up to 8 GiB a rank)"""
    logp_chunk: int = 1024
    """response positions projected onto the vocabulary at once (recomputed in backward; 0 = all)"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's and vision block's activations in backward, not keep them"""
    offload: bool = False
    """FSDP2 CPU offload: parameter shards, gradients, AdamW state in CPU memory (CUDA, torchrun)"""
    fsdp: Literal["auto", "reshard", "keep", "replicate"] = "auto"
    """several ranks' parameters: FSDP2 blocks gathered in forward and again in backward (reshard)
    or kept from one to the other (keep); whole, the gradients summed in one all-reduce (replicate,
    fp32 compute); auto: fsdp_choice's pick"""
    max_tokens_per_micro_batch: int = 0
    """micro-batch budget: rows x (longest prompt + response), for micro_batch_size (0 = off)"""
    sp_size: int = fact(1, POSITIVE)
    """sequence parallelism (sp.py): sp_size ranks train the same rows, each 1/sp_size of them"""
    # --- optimizer
    lr: float = fact(1e-6, POSITIVE)
    """peak learning rate"""
    min_lr_ratio: float = 0.1
    """cosine decays to lr * min_lr_ratio at max_steps"""
    warmup_steps: int = fact(0, NOT_NEGATIVE)
    """linear warmup steps"""
    weight_decay: float = fact(0.0, NOT_NEGATIVE)
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """max global grad norm"""
    max_steps: int = fact(100, POSITIVE, MAY_CHANGE_ON_RESUME)
    """optimizer steps"""
    seed: int = 0
    """seed for data order, sampling and init"""
    # --- log, eval, save
    eval_every: int = fact(0, NOT_NEGATIVE, MAY_CHANGE_ON_RESUME)
    """greedy held-out accuracy every N steps (0 = only before and after training)"""
    eval_max_samples: int = fact(256, NOT_NEGATIVE)
    """cap on held-out samples per evaluation"""
    save: bool = fact(True, MAY_CHANGE_ON_RESUME)
    """save an HF-format checkpoint (loads in vLLM and transformers) at the end"""
    wandb_project: str = fact("", MAY_CHANGE_ON_RESUME)
    """wandb project ('' = off); online, offline or disabled as `wandb login` and WANDB_MODE say"""
    log_every: int = fact(1, NOT_NEGATIVE, MAY_CHANGE_ON_RESUME)
    """write sampled completions to out_dir/samples.jsonl (and wandb) every N steps (0 = never)"""
    log_samples: int = fact(4, POSITIVE, MAY_CHANGE_ON_RESUME)
    """completions written per logged step: the first of each of that many groups"""
    # --- long runs (checkpoint section)
    save_every: int = fact(0, NOT_NEGATIVE, MAY_CHANGE_ON_RESUME)
    """sharded checkpoint out_dir/ckpt/step_00000050 (8 digits) every N steps (0 = on SIGTERM/SIGINT only)"""
    keep_last: int = fact(2, NOT_NEGATIVE, MAY_CHANGE_ON_RESUME)
    """checkpoints kept, older ones are deleted (0 = keep all)"""
    resume: str = fact("", MAY_CHANGE_ON_RESUME)
    """'' = fresh (refused if out_dir/ckpt holds a run) | auto = out_dir/ckpt's latest checkpoint (if any) | a folder"""
    allow_config_change: bool = fact(False, MAY_CHANGE_ON_RESUME)
    """resume with settings other than the checkpoint's (else refused, naming them), but for MAY_CHANGE_ON_RESUME
    ones: the run's length, logging, evaluation cadence, saving, timeouts"""
    dist_timeout: float = fact(1800.0, POSITIVE, MAY_CHANGE_ON_RESUME)
    """seconds a collective may wait: a dead or stuck rank fails the run instead of hanging it"""
    stop_grace_s: float = fact(300.0, NOT_NEGATIVE, MAY_CHANGE_ON_RESUME)
    """after a SIGTERM/SIGINT, seconds a step may take to reach its boundary and checkpoint; a step
    stuck longer is abandoned: where is printed, exit 1, the last checkpoint kept (0 = no limit)"""
    # --- LoRA (peft): the base model stays frozen, only the adapters train
    lora_rank: int = 0
    """adapter rank r (0 = full fine-tuning); the reference: the model, adapters scaled to 0"""
    lora_alpha: float = 16.0
    """the adapter's update is lora_alpha / lora_rank * B A"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input in the loss forward (not in log-prob passes, the sampler)"""
    lora_targets: str = (
        r"(.*language_model|model)\.layers\..*\."
        r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    )
    """regex (full match) over module names getting adapters: the text model's attention and MLP (Omni's thinker:
    model.layers; its audio tower's are left out);
    for the vision tower and merger append `|.*visual.blocks.*(qkv|proj)|.*merger.mlp.[02]`"""

    def media(self, held_out: bool = False) -> Media:
        """The media settings data.prepare reads; held_out: a val_<name> field that is set replaces <name>."""
        media = {f.name: getattr(self, f.name) for f in fields(Media)}
        for name in media:
            if held_out and getattr(self, f"val_{name}", 0):
                media[name] = getattr(self, f"val_{name}")
        return Media(**media)


def load_config(argv: list[str]) -> Config:
    """common.load_config for Config: configs/tiny_cpu.yaml has a run's settings, others recipes."""
    return common.load_config(Config, argv)


def check_config(cfg: Config, world: int = 1):
    """Every setting and combination that cannot work fails here, all of them in one error, before anything loads:
    first what each field's own facts refuse (common.field_errors: choices, finite, bounds), then combinations."""
    bad = common.field_errors(cfg)
    dp = world // max(1, cfg.sp_size)  # data-parallel ranks: an SP group trains the same rows
    per_rank = cfg.prompts_per_step // max(1, dp) * cfg.group_size  # rollouts per rank and step
    longest_row = cfg.max_prompt_len + cfg.max_response_len
    spec = model_spec(cfg.model) or {}
    moe = "num_experts_per_tok" in spec.get("thinker_config", spec).get("text_config", spec)
    omni = "thinker_config" in spec  # Qwen2.5-Omni: audio in, thinker trained
    cuda_ranks = torch.cuda.is_available() and dist.is_initialized()
    # each message, and whether this config earns it
    rules = {
        f"prompts_per_step {cfg.prompts_per_step} % data-parallel size {dp} != 0": (
            dp and cfg.prompts_per_step % dp
        ),
        f"world size {world} % rollout_tp {cfg.rollout_tp} != 0": (
            cfg.rollout_tp > 0 and world % cfg.rollout_tp
        ),
        f"world size {world} % sp_size {cfg.sp_size} != 0": (
            cfg.sp_size > 0 and world % cfg.sp_size
        ),
        # a TP group generates inside one SP group
        f"sp_size {cfg.sp_size} % rollout_tp {cfg.rollout_tp} != 0": (
            cfg.sp_size > 1 and cfg.rollout_tp > 0 and cfg.sp_size % cfg.rollout_tp
        ),
        "rollout_tp > 1 needs rollout vllm": cfg.rollout == "hf" and cfg.rollout_tp > 1,
        "vllm_embeds needs freeze_vision and rollout vllm (the features never change)": (
            cfg.vllm_embeds and not (cfg.freeze_vision and cfg.rollout == "vllm")
        ),
        f"mini_batches {cfg.mini_batches} > {per_rank} rollouts per rank and step": (
            cfg.mini_batches > per_rank
        ),
        f"clip_ratio_c {cfg.clip_ratio_c} must be > 1 (or 0 = off)": (
            cfg.clip_ratio_c and cfg.clip_ratio_c <= 1
        ),
        f"min_lr_ratio {cfg.min_lr_ratio} must be in [0, 1]": not 0 <= cfg.min_lr_ratio <= 1,
        f"gpu_memory_utilization {cfg.gpu_memory_utilization} must be <= 1": (
            cfg.gpu_memory_utilization > 1
        ),
        f"mix_threshold {cfg.mix_threshold} must be <= 1 (an accuracy)": cfg.mix_threshold > 1,
        "mix_threshold needs mix_offline": cfg.mix_threshold and not cfg.mix_offline,
        f"overlong_buffer {cfg.overlong_buffer} must be <= 1 (of max_response_len)": (
            cfg.overlong_buffer > 1
        ),
        # no rollouts
        "loss_type sft needs group_size 1, kl_coef 0, no dynamic_sampling, vllm_embeds, gae": (
            cfg.loss_type == "sft"
            and (
                cfg.group_size > 1
                or cfg.kl_coef
                or cfg.dynamic_sampling
                or cfg.vllm_embeds
                or cfg.adv_estimator == "gae"
            )
        ),
        "max_prompt_len > max_model_len": (
            cfg.rollout == "vllm" and cfg.max_prompt_len > cfg.max_model_len
        ),
        "video_min_frames > video_max_frames": cfg.video_min_frames > cfg.video_max_frames,
        "video_min_pixels > video_max_pixels": cfg.video_min_pixels > cfg.video_max_pixels,
        "image_min_pixels > image_max_pixels": cfg.image_min_pixels > cfg.image_max_pixels,
        "video_source cache_only needs a cache_dir": (
            cfg.video_source == "cache_only" and not cfg.cache_dir
        ),
        "kl_in_reward needs kl_coef > 0 (0 loads no reference model)": (
            cfg.kl_in_reward and not cfg.kl_coef
        ),
        # each would ask; a flaky judge could make them disagree
        "judge_url needs sp_size 1 (an SP group's ranks score the same answers)": (
            cfg.judge_url and cfg.sp_size > 1
        ),
        "grpo_passk needs group_size >= 2 (a best and a second-best response)": (
            cfg.adv_estimator == "grpo_passk" and cfg.group_size < 2
        ),
        "kl_in_reward: gdpo's reward components carry no KL": (
            cfg.kl_in_reward and cfg.adv_estimator == "gdpo"
        ),
        f"gamma {cfg.gamma} and lam {cfg.lam} must be in [0, 1]": not (
            0 <= cfg.gamma <= 1 and 0 <= cfg.lam <= 1
        ),
        "critic_warmup needs adv_estimator gae (a critic)": (
            cfg.critic_warmup and cfg.adv_estimator != "gae"
        ),
        "adv_estimator gae needs sp_size 1 (the critic is not sequence-parallel)": (
            cfg.adv_estimator == "gae" and cfg.sp_size > 1
        ),
        f"router_aux_loss: {cfg.model} has no routers (not a MoE model)": (
            cfg.router_aux_loss and not moe
        ),
        # each rank would balance its shard's tokens
        "router_aux_loss needs sp_size 1": cfg.router_aux_loss and cfg.sp_size > 1,
        # Ulysses swaps the attention kernel only: a gated delta-net layer would run its
        # recurrence over the rank's own positions (docs/families.md)
        f"sp_size {cfg.sp_size}: {cfg.model}'s linear-attention layers need sp_size 1": (
            cfg.sp_size > 1 and linear_attention(spec)
        ),
        f"video_audio: {cfg.model} hears nothing (an Omni model does)": cfg.video_audio
        and not omni,
        # the soundtrack's span is not split over an SP group's ranks, nor fed to vLLM as features
        f"{cfg.model} (Omni) needs sp_size 1 and no vllm_embeds": (
            omni and (cfg.sp_size > 1 or cfg.vllm_embeds)
        ),
        f"resume {cfg.resume!r}: no such folder": (
            cfg.resume not in ("", "auto") and not os.path.isdir(cfg.resume)
        ),
        f"temperature {cfg.temperature} must be >= 1e-5 (vLLM samples greedily below it, "
        "and greedy rollouts cannot be trained: the trainer's logits / 0 are NaN)": (
            cfg.temperature < 1e-5
        ),
        f"lora_rank {cfg.lora_rank} must be >= 0 (0 = full fine-tuning)": cfg.lora_rank < 0,
        f"lora_dropout {cfg.lora_dropout} must be in [0, 1)": not 0 <= cfg.lora_dropout < 1,
        f"offload (FSDP2's CPU offload of shards) needs fsdp reshard, not {cfg.fsdp}": (
            cfg.offload and cfg.fsdp not in ("auto", "reshard")
        ),
        "offload: FSDP2's CPU offload of GPU memory needs CUDA and torchrun": (
            cfg.offload and not cfg.world and not cuda_ranks
        ),
        f"max_tokens_per_micro_batch {cfg.max_tokens_per_micro_batch} < max_prompt_len + "
        f"max_response_len {longest_row}: the longest row fits in none": (
            0 < cfg.max_tokens_per_micro_batch < longest_row
        ),
    }
    bad += [message for message, wrong in rules.items() if wrong]
    if cfg.judge_url:
        bad += rewards.judge_problems(cfg)
    if cfg.rollout == "vllm" and cfg.rollout_tp > 0 and cfg.max_model_len > 0:
        bad += engine_errors(cfg.model, cfg.rollout_tp, cfg.max_model_len)  # vLLM's own checks
    if bad:
        raise UserError("invalid config:\n  " + "\n  ".join(bad))


def check_files(cfg: Config, ckpt_path: str):
    """Before anything loads: the data files exist, a fresh run never writes into another run's checkpoints, a resume
    keeps the checkpoint's settings but those MAY_CHANGE_ON_RESUME (or with allow_config_change)."""
    for name in ("train_data", "val_data", "prompt_template"):
        path = getattr(cfg, name)
        if path and not os.path.isfile(path):
            raise UserError(f"{name} {path}: no such file")
    if not ckpt_path:
        if os.path.exists(os.path.join(cfg.out_dir, "ckpt", "latest")):
            raise UserError(
                f"{cfg.out_dir} holds another run's checkpoints: continue it with --resume auto, or "
                "give another --out-dir"
            )
        return
    with open(os.path.join(ckpt_path, "meta.json")) as f:
        saved = json.load(f)["config"]
    changed = [
        f"{f.name} {saved[f.name]!r} -> {getattr(cfg, f.name)!r}"
        for f in fields(cfg)
        if f.name in saved and "resume" not in f.metadata and getattr(cfg, f.name) != saved[f.name]
    ]
    if changed and not cfg.allow_config_change:
        raise UserError(
            f"{ckpt_path} was trained with other settings ({', '.join(changed)}): resume with its own, "
            "or pass --allow-config-change"
        )


def dry_run(cfg: Config, processor, template, samples: dict, skipped: list):
    """--dry-run: the resolved config (YAML that --config reads back), the data counts and, per
    split, the prompt length (vision tokens included) of the sample with the most media and text."""
    import yaml

    resolved = {k: v for k, v in asdict(cfg).items() if k not in ("config", "dry_run", "world")}
    print(yaml.safe_dump(resolved, sort_keys=False), end="")
    counts = [f"{len(rows)} {split}" for split, rows in samples.items()]
    print(f"data: {', '.join(counts)}, {len(skipped)} skipped")

    def size(s: dict) -> tuple[int, int]:
        """Media items, then text tokens: the sample whose prompt is likely the longest has the most."""
        text = data.render_prompt(s, template, cfg.response_format)
        return len(data.media_paths(s)), len(processor.tokenizer(text).input_ids)

    for split, rows in samples.items():
        if not rows:
            continue
        longest = max(rows, key=size)
        prompt = data.prepare(
            longest,
            processor,
            cfg.media(held_out=split == "val"),
            template=template,
            response_format=cfg.response_format,
            max_prompt_len=cfg.max_prompt_len,
        )
        print(
            f"{split}: longest prompt {len(prompt.prompt_ids)} tokens (sample {longest['id']}, "
            f"max_prompt_len {cfg.max_prompt_len})"
        )


# --------------------------------------------------------------------------------------------------
# The algorithm: small pure tensor functions. B = sequences, R = response tokens.


def whiten(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten: (x - mean) / sqrt(var + 1e-8), token-weighted mean, unbiased variance;
    x, weight: per token (B, R) and mask, or per sequence (B,) and lengths (once per token)."""
    w = weight.to(x.dtype)
    n = w.sum()
    mean = (w * x).sum() / n
    var = (w * (x - mean) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def reward_to_go(x: torch.Tensor) -> torch.Tensor:
    """Sum from each token to the end of its row (gamma 1): (B, R) -> (B, R)."""
    return x.flip(-1).cumsum(-1).flip(-1)


def advantages(
    reward: torch.Tensor,
    group_size: int,
    estimator: str = "grpo",
    response_len: int = 1,
    lengths=None,
    baseline=None,
    components=None,
    kl_to_go=None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages (B, response_len), float64, of rewards (B,) in groups of group_size rows
    (docs/algorithms.md): one shape for every estimator, a sequence's value at each of its tokens.
    lengths: whitening weights, baseline: remax, components: gdpo, all (B,). kl_to_go
    (B, response_len), KL in the reward: reinforce++ and remax take each token's return; the
    others the sequence's (its first token's)."""
    reward = reward.double()
    if kl_to_go is not None and estimator in ("reinforce++", "remax"):
        mask = (torch.arange(kl_to_go.shape[1])[None] < lengths[:, None]).double()  # (B, R)
        returns = (reward[:, None] - kl_to_go.double()) * mask  # (B, R)
        if estimator == "remax":
            return (returns - baseline.double()[:, None]) * mask
        return whiten(returns, mask) * mask
    if kl_to_go is not None:
        reward = reward - kl_to_go[:, 0]  # the sequence's KL
    per_sequence = sequence_advantages(
        reward, group_size, estimator, lengths, baseline, components, eps
    )  # (B,)
    return per_sequence[:, None].expand(-1, response_len)


def sequence_advantages(
    reward: torch.Tensor,
    group_size: int,
    estimator: str,
    lengths=None,
    baseline=None,
    components=None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One advantage per sequence (B,), float64: what `advantages` spreads over the tokens."""
    r = reward.double().view(-1, group_size)  # (G, n)
    centered = r  # a group of 1
    std = torch.ones_like(r)
    if group_size > 1:
        std = r.std(-1, keepdim=True)  # (G, 1)
        same = (r == r[:, :1]).all(-1, keepdim=True)  # (G, 1)
        centered = torch.where(same, 0.0, r - r.mean(-1, keepdim=True))  # exactly 0, no rounding
    if estimator == "grpo":
        return (centered / (std + eps)).view(-1)
    if estimator == "drgrpo":
        return centered.view(-1)
    if estimator == "rloo":  # r_i - mean of others = n / (n - 1) * (r_i - mean); a group of 1: r_i
        return (centered * group_size / max(1, group_size - 1)).view(-1)
    if estimator == "reinforce++":
        return whiten(reward.double(), lengths)
    if estimator == "reinforce++-baseline":
        return whiten(centered.view(-1), lengths)
    if estimator == "remax":
        return reward.double() - baseline.double()
    if estimator == "grpo_passk":  # only the group's best gets its lead on the rest (a tie: 0)
        top = r.topk(2, dim=-1)  # values, indices: (G, 2)
        lead = (top.values[:, :1] - top.values[:, 1:]) / (std + eps)  # (G, 1)
        return torch.zeros_like(r).scatter(-1, top.indices[:, :1], lead).view(-1)
    if estimator == "gdpo":  # GRPO per reward component, summed (equal weights), batch-whitened
        summed = sum(sequence_advantages(c, group_size, "grpo", eps=eps) for c in components)
        return whiten(summed, lengths)
    raise ValueError(f"adv_estimator: unknown {estimator!r}")


def policy_loss(
    logp, old_logp, adv, mask, loss_type: str = "ppo", clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0
):
    """Per-token loss and clipped indicator, (B, R) each (docs/algorithms.md); adv (B,), (B, R)."""
    if loss_type not in ("ppo", "gspo", "cispo", "sft"):
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    if loss_type == "sft":  # the reference response's NLL: no ratio, no advantage, nothing clipped
        return -logp, torch.zeros_like(logp)
    a = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # (B, 1) or (B, R)
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # (B, R)
    if loss_type == "gspo":  # the sequence's mean log-ratio, with each token's gradient
        seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(1)
        ratio = torch.exp((seq.detach() + logp - logp.detach()).clamp(max=10.0))  # (B, R)
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    if loss_type == "cispo":
        return -clipped_ratio.detach() * a * logp, (ratio != clipped_ratio).float()
    loss1 = -a * ratio
    loss2 = -a * clipped_ratio
    loss = torch.maximum(loss1, loss2)
    if loss_type == "ppo" and clip_ratio_c:  # dual-clip
        loss = torch.where(a < 0, torch.minimum(loss, -a * clip_ratio_c), loss)
    return loss, (loss2 > loss1).float()


def agg_loss(x, mask, mode: str, n_tok: float, n_seq: float, max_len: int) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: x, mask (b, R) -> scalar. n_tok / n_seq: the
    mini-batch's valid tokens / sequences over all ranks, so the shares sum to the exact loss."""
    if mode == "token-mean":
        return (x * mask).sum() / n_tok
    seq = (x * mask).sum(-1)  # (b,)
    if mode == "seq-mean-token-mean":
        seq = seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        seq = seq / max_len
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg: unknown {mode!r}")
    return seq.sum() / n_seq


def kl_penalty(logp, ref_logp, kind: str = "k3"):
    """Per-token KL(pi || ref): k1 d, abs |d|, k2 d^2 / 2, k3 exp(-d) + d - 1 (clamped as verl)."""
    d = logp - ref_logp  # (B, R)
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


def gae_advantages(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
    """verl's compute_gae_advantage_return: per-token rewards, the critic's values, mask (B, R) ->
    advantages (whitened over the batch's tokens, 0 off the mask) and returns (B, R). A masked
    token passes the next real token's value and advantage through unchanged."""
    next_value = torch.zeros_like(values[:, 0])  # (B,) V of the next real token
    last = torch.zeros_like(values[:, 0])  # (B,) its advantage
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,) TD error
        real = mask[:, t] > 0
        next_value = torch.where(real, values[:, t], next_value)
        last = torch.where(real, delta + gamma * lam * last, last)
        adv[:, t] = last
    return whiten(adv, mask) * mask, adv + values


def value_loss(vpred, old_values, returns, clip: float = 0.5):
    """verl's compute_value_loss per token, before aggregation: 0.5 max((V - G)^2, (clip(V, V_old
    +- clip) - G)^2) and where the clipped term won, (B, R) each."""
    clipped = vpred.clamp(old_values - clip, old_values + clip)
    loss1 = (vpred - returns) ** 2
    loss2 = (clipped - returns) ** 2
    return 0.5 * torch.maximum(loss1, loss2), (loss2 > loss1).float()


def is_weight(
    old_logp, rollout_logp, mask, level: str = "token", cap: float = 2.0, mode: str = "truncate"
):
    """Truncated importance weight pi_old / pi_rollout (B, R), no gradient; 1 on rows without
    rollout log-probs (NaN: offline). sequence: one weight per row from the summed log-ratio."""
    log_ratio = torch.where(rollout_logp.isnan(), 0.0, old_logp - rollout_logp) * mask  # (B, R)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    w = torch.exp(log_ratio.clamp(-20, 20)).detach() * mask
    return w.clamp(max=cap) if mode == "truncate" else w * (w <= cap)


def overlong_penalty(length: int, max_len: int, buffer: float) -> float:
    """DAPO's soft overlong penalty: 0 up to max_len - buffer tokens, linear to -1 at max_len."""
    return max(-1.0, min(0.0, (max_len - buffer - length) / buffer))


def split_batch(
    rollouts: list[Rollout],
    mini_batches: int,
    micro_batch_size: int,
    max_tokens: int = 0,
    by_length: bool = False,
) -> list[list[list[int]]]:
    """Row indices per micro-batch per mini-batch. Mini-batches: contiguous, sizes within 1.
    Micro-batches: rows in order (by_length: a mini-batch's rows shortest first, so the budget
    fills with rows of like length, not padding), at most micro_batch_size rows or (max_tokens > 0)
    max_tokens padded tokens, rows x (longest prompt + longest response). A group (media encoded
    once per micro-batch) that does not fit the current micro-batch starts a new one, unless it fits
    in none."""

    def fits(rows: list[int]) -> bool:
        if not max_tokens:
            return len(rows) <= micro_batch_size
        prompt = max(len(rollouts[j].prompt.prompt_ids) for j in rows)
        return len(rows) * (prompt + max(len(rollouts[j].response_ids) for j in rows)) <= max_tokens

    n = len(rollouts)
    bounds = [n * j // mini_batches for j in range(mini_batches + 1)]
    plan = []
    for lo, hi in zip(bounds, bounds[1:]):
        order = range(lo, hi)
        if by_length:
            r = rollouts
            order = sorted(
                order, key=lambda j: len(r[j].prompt.prompt_ids) + len(r[j].response_ids)
            )
        micro = [[]]
        for _, run in itertools.groupby(order, key=lambda j: id(rollouts[j].prompt)):
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


# --------------------------------------------------------------------------------------------------
# The loss on a micro-batch and what it reads: old/ref log-probs, KL-in-reward, global advantages


def chunk_logp(hidden, weight, targets, temperature: float, banned: list[int]):
    """Targets' log-probs and entropy at temperature: hidden (N, D), targets (N,) -> (N,), (N,)."""
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature  # (N, V)
    logits[:, banned] = -1e9  # the sampler masks vision tokens; finite so entropy has no 0 * inf
    lse = torch.logsumexp(logits, -1)  # (N,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)  # stable form, as verl
    return logp, entropy


class ChunkedLogp(torch.autograd.Function):
    """chunk_logp over N positions, `chunk` at a time, keeping no logits for backward, which
    recomputes each chunk's and adds its weight gradient to one buffer: (chunk, V) logits live."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, banned: list[int], chunk: int):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature = temperature
        ctx.banned = banned
        ctx.chunk = chunk
        parts = [
            chunk_logp(hidden[i : i + chunk], weight, targets[i : i + chunk], temperature, banned)
            for i in range(0, max(1, len(targets)), chunk)
        ]  # an SP rank may have no targets
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden = ctx.saved_tensors[0]  # (N, D)
        weight = ctx.saved_tensors[1]  # (V, D)
        targets = ctx.saved_tensors[2]  # (N,)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        for i in range(0, len(targets), ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            h = hidden[rows]  # (n, D)
            y = targets[rows]  # (n,)
            z = torch.nn.functional.linear(h, weight).float() / ctx.temperature  # (n, V)
            z[:, ctx.banned] = -1e9
            p = torch.softmax(z, -1)
            gl = grad_logp[rows, None]  # (n, 1)
            ge = grad_entropy[rows, None]  # (n, 1)
            # d logp / dz = onehot(y) - p;  d entropy / dz = -p (z - sum_v p z)
            dz = -p * (gl + ge * (z - (p * z).sum(-1, keepdim=True)))
            dz.scatter_add_(1, y[:, None], gl)
            dz[:, ctx.banned] = 0.0
            dz = (dz / ctx.temperature).to(weight.dtype)
            grad_hidden[rows] = dz @ weight
            grad_weight.addmm_(dz.T, h)
        return grad_hidden, grad_weight, None, None, None, None


@dataclass
class MicroBatch:
    """One micro-batch (collate): b rows, P prompt positions (left-padded), R response positions
    (right-padded). logp_pass sets old_logp, ref_logp and vision; train_phase sets adv."""

    input_ids: torch.Tensor  # (b, P + R) prompt and response tokens
    attention_mask: torch.Tensor  # (b, P + R)
    response_ids: torch.Tensor  # (b, R) the response part of input_ids
    mask: torch.Tensor  # (b, R) 1 on response tokens
    rollout_logp: torch.Tensor  # (b, R) the sampler's; NaN: none (offline trajectory)
    prompts: list  # the rows' data.Prompt (media); a group's rows share one
    grids: dict  # the rows' M-RoPE inputs (data.grids)
    dummies: dict | None  # data.dummy_prompts (FSDP, several ranks): a modality no row has
    index: list[int]  # the rows' places in the step's rollouts on this rank
    old_logp: torch.Tensor | None = None  # (b, R) no grad; None: on-policy, old = sg[logp]
    ref_logp: torch.Tensor | None = None  # (b, R) the reference's (kl_coef > 0)
    adv: torch.Tensor | None = None  # (b, R)
    vision: sp.Vision | None = None  # encode_vision's features, when encoded once per step
    values: torch.Tensor | None = None  # (b, R) gae: the critic's, before its update
    returns: torch.Tensor | None = None  # (b, R) gae: its targets
    n_tok: float = 0.0  # micro_batches: its mini-batch's global_counts (SP: each row once)
    n_seq: float = 0.0


@dataclass
class Counts:
    """What a step's log-prob passes did, counted where it happens (token_logp)."""

    encodes: int = 0  # media items through the vision tower (vision/encodes)


def token_logp(
    model,
    batch: MicroBatch,
    temperature: float,
    banned: list[int],
    chunk: int = 0,
    layout=None,
    counts: Counts | None = None,
):
    """Log-prob and entropy of each response token at the sampling temperature: (b, R), (b, R).
    Media are encoded once per distinct item (added to counts.encodes) unless batch.vision holds
    them; `chunk` positions are projected at a time (0 = all). sp_size > 1 (layout): each SP rank
    computes its share (sp.py) and returns the whole."""
    rows, R = batch.mask.shape
    hidden, shard = response_hidden(model, batch, layout, counts)
    a, b = shard.response_span(R)
    hidden = hidden.flatten(0, 1)  # (b r, D)
    # FSDP2 keeps the root's parameters unsharded until backward
    weight = model.get_output_embeddings().weight
    targets = batch.response_ids[:, a:b].flatten()  # (b r,)
    chunk = chunk or max(1, len(targets))
    logp, entropy = ChunkedLogp.apply(hidden, weight, targets, temperature, banned, chunk)
    return shard.gather(logp.view(rows, b - a), R), shard.gather(entropy.view(rows, b - a), R)


def response_hidden(model, batch: MicroBatch, layout=None, counts: Counts | None = None):
    """The last layer's hidden states (b, r, D) at the positions that predict this rank's response
    tokens [a, b) (its sp.Shard's response_span; sp_size 1: all R), and that Shard."""
    vision = batch.vision
    if vision is None:
        device = batch.input_ids.device
        vision = sp.encode_vision(model, batch.prompts, device, layout, batch.dummies)
        if counts is not None:
            counts.encodes += vision.encodes
    inputs, shard = sp.model_inputs(model, batch, vision, layout)
    # logits_to_keep=1: the model's own projection covers one position, ours below the responses
    out = model(**inputs, logits_to_keep=1, use_cache=False, output_hidden_states=True)
    # token 0 is predicted at position length - R - 1
    R = batch.mask.shape[1]
    a, b = shard.response_span(R)
    first = shard.length - R - 1 - shard.start + a
    return out.hidden_states[-1][:, first : first + b - a], shard


def collate(
    rollouts: list[Rollout],
    pad_id: int,
    device,
    dummies: dict | None = None,
    index: list[int] | None = None,
) -> MicroBatch:
    """One micro-batch: left-padded prompts, right-padded responses, the rows' prompts (media) and
    M-RoPE grids. dummies (data.dummy_prompts, FSDP2 on several ranks): the inputs token_logp's
    encode_vision runs through the tower for a modality no row has, weight 0 (never a decoder
    row). index: the rows' places in the step's rollouts (default 0..b-1)."""
    P = max(len(r.prompt.prompt_ids) for r in rollouts)
    R = max(max(len(r.response_ids) for r in rollouts), 1)
    B = len(rollouts)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R))
    rollout_logp = torch.full((B, R), float("nan"))  # NaN: no sampler log-probs (offline)
    for i, r in enumerate(rollouts):
        p = r.prompt.prompt_ids
        y = r.response_ids
        input_ids[i, P - len(p) : P] = torch.tensor(p)
        input_ids[i, P : P + len(y)] = torch.tensor(y, dtype=torch.long)
        attn[i, P - len(p) : P + len(y)] = 1
        mask[i, : len(y)] = 1
        if r.logp:
            rollout_logp[i, : len(y)] = torch.tensor(r.logp)
    if index is None:
        index = list(range(B))
    prompts = [r.prompt for r in rollouts]
    input_ids = input_ids.to(device)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attn.to(device),
        response_ids=input_ids[:, P:],
        mask=mask.to(device),
        rollout_logp=rollout_logp.to(device),
        prompts=prompts,
        grids=data.grids(prompts, device),
        dummies=dummies,
        index=index,
    )


@contextlib.contextmanager
def as_reference(model, ref):
    """The reference: the frozen copy `ref`, or with LoRA (ref None) the policy, adapters scaled to
    0. Not peft's disable_adapter: under FSDP2 its requires_grad toggle reaches only the root's
    unsharded copies; root-held adapters (the merger) would stop training."""
    from peft.helpers import rescale_adapter_scale

    if ref is not None:
        yield ref
        return
    with rescale_adapter_scale(model, 0.0):
        yield model


def micro_batches(
    rollouts: list[Rollout], cfg: Config, tok, device, dummies, lengths: list | None = None
) -> list[list[MicroBatch]]:
    """The rollout batch as mini-batches of collated micro-batches (split_batch). All ranks run as
    many (FSDP): a rank the token budget packed into fewer halves its largest. lengths: every
    data-parallel rank's response lengths (global_rows'; default: these rollouts', one rank), each
    rank's mini-batches alike: each micro-batch's n_tok, n_seq without a collective."""
    sft = cfg.loss_type == "sft"  # its rows are groups of one: free to sort
    plan = split_batch(
        rollouts, cfg.mini_batches, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, sft
    )
    counts = all_reduce([float(len(mini)) for mini in plan], op=dist.ReduceOp.MAX)
    if lengths is None:
        lengths = [len(r.response_ids) for r in rollouts]
    every = torch.tensor(lengths).view(-1, len(rollouts))  # (data-parallel ranks, rows)
    minibatches = []
    for mini, count in zip(plan, counts):
        part = every[:, [j for rows in mini for j in rows]]  # the mini-batch's rows on every rank
        while len(mini) < count:
            big = max(mini, key=len)
            at = mini.index(big)
            mini[at : at + 1] = [big[: len(big) // 2], big[len(big) // 2 :]]
        minibatches.append(
            [
                collate([rollouts[j] for j in rows], tok.pad_token_id, device, dummies, index=rows)
                for rows in mini
            ]
        )
        for b in minibatches[-1]:
            b.n_tok, b.n_seq = float(part.sum()), float((part > 0).sum())
    return minibatches


def micro_loss(
    model,
    b: MicroBatch,
    cfg: Config,
    banned: list[int],
    layout=None,
    counts: Counts | None = None,
):
    """This micro-batch's share of its mini-batch loss (summed over micro-batches and ranks: the
    mini-batch loss) and its metric sums. b.old_logp None: on-policy, old = sg[logp]."""
    temperature = cfg.temperature
    if cfg.loss_type == "sft":  # the data's likelihood, not the sampler's tempered one
        temperature = 1.0
    routers = []  # each sparse layer's router logits (tokens, experts) of this forward
    hooks = []
    if cfg.router_aux_loss:
        for name, m in model.named_modules():
            if name.endswith("mlp.gate"):  # transformers' records of router_logits: output 0
                hooks.append(m.register_forward_hook(lambda _, x, out: routers.append(out[0])))
    logp, ent = token_logp(model, b, temperature, banned, cfg.logp_chunk, layout, counts)
    for h in hooks:
        h.remove()
    mask = b.mask  # (b, R)
    old = b.old_logp
    if old is None:
        old = logp.detach()
    pg, clipped = policy_loss(
        logp,
        old,
        b.adv,
        mask,
        loss_type=cfg.loss_type,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        clip_ratio_c=cfg.clip_ratio_c,
    )
    w = torch.ones_like(mask)  # the TIS weight, 1 when off
    if cfg.tis:
        w = is_weight(old, b.rollout_logp, mask, level=cfg.tis, cap=cfg.tis_cap, mode=cfg.tis_mode)
    kl = torch.zeros_like(mask)
    if b.ref_logp is not None and not cfg.kl_in_reward:
        kl = kl_penalty(logp, b.ref_logp, cfg.kl_type)
    bonus = ent if cfg.entropy_coef else ent.detach()  # no graph through entropy unless in the loss
    norm = dict(mode=cfg.loss_agg, n_tok=b.n_tok, n_seq=b.n_seq, max_len=cfg.max_response_len)
    loss = (
        agg_loss(pg * w, mask, **norm)
        - cfg.entropy_coef * agg_loss(bonus, mask, **norm)
        + cfg.kl_coef * agg_loss(kl, mask, **norm)
    )
    aux = torch.zeros(())
    if routers:  # this micro-batch's part: its tokens' share (transformers' aux_loss, padding out)
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        text = model.config.get_text_config()
        balance = load_balancing_loss_func(
            tuple(routers), text.num_experts, text.num_experts_per_tok, b.attention_mask
        )
        aux = balance * mask.sum() / b.n_tok
        loss = loss + cfg.router_aux_loss_coef * aux
    with torch.no_grad():
        has = ~b.rollout_logp.isnan() & (mask > 0)  # health: sampler vs trainer log-probs
        d = torch.where(has, (old - b.rollout_logp).abs(), 0.0)
        sums = dict(clipfrac=clipped, entropy=ent, kl=kl, mismatch_sum=d, mismatch_n=has)
        if cfg.tis:
            raw = is_weight(old, b.rollout_logp, mask, level=cfg.tis, cap=float("inf"))
            sums.update(tis_weight=w, tis_clipped=(w != raw) & has)
        metrics = {k: (v * mask).sum().item() for k, v in sums.items()}  # over the response tokens
        metrics.update(loss=loss.item(), mismatch_max=d.max().item(), router_aux=aux.item())
    return loss, metrics


def global_tokens(per_batch: list[torch.Tensor], cfg: Config, layout: sp.Layout) -> torch.Tensor:
    """Per-token values of this rank's micro-batches (b, R) each, in order, as every data-parallel
    rank's rows in global_rows' order, zero-padded: (B_all, max_response_len) float64."""
    padded = [torch.nn.functional.pad(x, (0, cfg.max_response_len - x.shape[1])) for x in per_batch]
    return torch.cat(layout.dedup(gather(torch.cat(padded).double().cpu())))


def gae_batch(rows: dict, values, kl, cfg: Config):
    """verl's GAE on the global batch (values, kl: global_tokens'; kl None: no KL in the reward):
    per-token reward -kl_coef * KL(old || ref), + the outcome reward at the last response token.
    Returns gae_advantages' advantages and returns, (B_all, max_response_len) each."""
    lengths = torch.tensor(rows["length"])  # (B,)
    mask = (torch.arange(values.shape[1])[None] < lengths[:, None]).double()  # (B, R)
    rewards = torch.zeros_like(values)
    if kl is not None:
        rewards = -cfg.kl_coef * kl
    last = (lengths - 1).clamp(min=0)  # an empty response has no token to reward
    score = torch.tensor(rows["reward"], dtype=torch.float64) * (lengths > 0)
    rewards[torch.arange(len(lengths)), last] += score
    return gae_advantages(rewards, values * mask, mask, cfg.gamma, cfg.lam)


def batch_advantages(rows: dict, kl_to_go, cfg: Config) -> torch.Tensor:
    """Advantages (B_all, max_response_len) of the global batch (global_rows: whitening needs every
    rank's rows). GDPO's reward components: accuracy, format (+ overlong)."""
    components = None
    if cfg.adv_estimator == "gdpo":
        keys = ["accuracy", "format"] + (["overlong"] if cfg.overlong_buffer else [])
        components = [
            torch.tensor([c[k] for c in rows["components"]], dtype=torch.float64) for k in keys
        ]
    adv = advantages(
        reward=torch.tensor(rows["reward"], dtype=torch.float64),
        group_size=cfg.group_size,
        estimator=cfg.adv_estimator,
        response_len=cfg.max_response_len,
        lengths=torch.tensor(rows["length"], dtype=torch.float64),
        baseline=torch.tensor(rows["baseline"], dtype=torch.float64),
        components=components,
        kl_to_go=kl_to_go,
        eps=cfg.adv_eps,
    )
    return adv.float()


# --------------------------------------------------------------------------------------------------
# Sampling and reward: groups are scored as generated (DAPO's dynamic sampling filters on them)


@dataclass
class Group:
    """A prompt's completions, their reward components (score: "overall" the reward), ReMax's
    baseline (or 0)."""

    rollouts: list[Rollout]
    components: list[dict]
    baseline: float = 0.0


def score(rollouts: list[Rollout], cfg: Config, judge: rewards.Judge | None = None) -> list[dict]:
    """rewards.compute_reward's components and "overall" (with a judge: rewards.judged_rewards', its
    requests in one batch), + DAPO's overlong penalty, a component."""
    texts = [r.text for r in rollouts]
    samples = [r.prompt.sample for r in rollouts]
    args = (cfg.w_acc, cfg.w_fmt, cfg.response_format)
    if judge is not None:
        comps = rewards.judged_rewards(judge, texts, samples, *args)
    else:
        comps = [rewards.compute_reward(t, s, *args)[1] for t, s in zip(texts, samples)]
    buffer = cfg.overlong_buffer * cfg.max_response_len
    for r, comp in zip(rollouts, comps):
        if buffer:
            comp["overlong"] = cfg.overlong_factor * overlong_penalty(
                len(r.response_ids), cfg.max_response_len, buffer
            )
            comp["overall"] += comp["overlong"]
    return comps


def offline_rollout(p, tok, eos_id: int, max_len: int) -> Rollout:
    """The sample's offline_output as a completion: its tokens + EOS (the policy learns to stop),
    truncated to max_len like any completion."""
    text = p.sample["offline_output"]
    ids = tok.encode(text, add_special_tokens=False) + [eos_id]
    return Rollout(p, ids[:max_len], None, text, "offline")


class OfflineEngine:
    """loss_type sft's sampler: each prompt's completions are its offline_output (sample_batch,
    unchanged, shares the prompts over ranks and scores them: reward/* reads the data's answers)."""

    encoder = None

    def __init__(self, tok, eos_id: int):
        self.tok = tok
        self.eos_id = eos_id

    def generate(self, prompts: list, n: int, temperature: float, max_tokens: int, seed: int):
        rollouts = [offline_rollout(p, self.tok, self.eos_id, max_tokens) for p in prompts]
        for r in rollouts:
            if r.response_ids[-1] != self.eos_id:  # cut at max_response_len: len/truncated
                r.finish = "length"
        return [r for r in rollouts for _ in range(n)]


def swap_offline(group: Group, cfg: Config, tok, eos_id: int, judge=None) -> Group:
    """Mixed offline-online: the sample's offline_output replaces the LAST rollout of its group
    (always, or with mix_threshold > 0 when the online accuracy is below it)."""
    p = group.rollouts[0].prompt
    online_acc = sum(c["accuracy"] for c in group.components) / len(group.components)
    sft = cfg.loss_type == "sft"  # its group is the offline_output already (cut: finish "length")
    if not cfg.mix_offline or sft or not p.sample.get("offline_output"):
        return group
    if cfg.mix_threshold and online_acc >= cfg.mix_threshold:
        return group
    offline = offline_rollout(p, tok, eos_id, cfg.max_response_len)
    comps = group.components[:-1] + score([offline], cfg, judge)
    return Group(group.rollouts[:-1] + [offline], comps, group.baseline)


def has_spread(group: Group, metric: str) -> bool:
    """DAPO's filter: the group's metric (accuracy or overall reward) differs among its rollouts."""
    values = [c["overall" if metric == "reward" else metric] for c in group.components]
    return len(values) == 1 or max(values) > min(values)


@dataclass
class Batch:
    """This rank's groups for one step, and what dynamic sampling did to get them."""

    groups: list[Group]
    skips: list[dict]  # samples that failed preparation (skip_invalid), replaced from the stream
    rounds: int = 1  # generation rounds
    dropped: int = 0  # groups dropped by dynamic sampling
    refilled: int = 0  # dropped groups taken back to fill the batch after max_gen_rounds


def sample_batch(
    engine,
    stream: data.Stream,
    samples: list,
    prep,
    cfg: Config,
    step: int,
    tok,
    eos_id: int,
    layout: sp.Layout,
    judge: rewards.Judge | None = None,
) -> Batch:
    """This rank's prompts_per_step / dp_size scored Groups. Per round: the TP group generates its
    share of the next prompts, SP ranks exchange theirs, ReMax scores a greedy baseline; DAPO drops
    groups without spread and repeats until all ranks are full or max_gen_rounds, then refills."""
    n = cfg.group_size
    need = cfg.prompts_per_step // layout.dp_size
    if engine.encoder is not None:  # vllm_embeds
        engine.encoder.new_step()
    kept = []  # groups with spread (all of them without dynamic sampling)
    dropped = []  # groups without: the refill
    skips = []
    for gen_round in range(max(1, cfg.max_gen_rounds)):
        prompts, new_skips = data.next_valid(
            stream,
            samples,
            prep,
            layout,
            cfg.prompts_per_step,
            cfg.skip_invalid,
            cfg.max_consecutive_invalid,
        )
        skips += new_skips
        seed = request_seed(cfg.seed, step, gen_round)
        # each prepared by one rank; its TP group's others get its frames (decoded once a group)
        prompts = sp.share_prompts(prompts, layout)
        processor = prep.keywords["processor"]  # a TP peer builds its runs from the frames
        shared = layout.share(prompts, layout.sp_size).items
        group_prompts = []  # sp_size > 1: its SP group's, each with this rank's run of pixel rows
        if layout.sp_size > 1 and engine.encoder is not None:  # vllm_embeds: the runs encoded
            group_prompts = sp.group_runs(shared, layout, processor)
            engine.encoder.prepare(prompts, group_prompts)  # and gathered, whole, for vLLM
        tp_share = layout.share(prompts, layout.tp)  # the TP group's prompts, and ours in them
        k = tp_share.count
        generated = engine.generate(
            tp_share.items, n, cfg.temperature, cfg.max_response_len, seed=seed
        )
        rollouts = generated[tp_share.start * n :][: k * n]
        baselines = [0.0] * k
        if cfg.adv_estimator == "remax":
            greedy = engine.generate(tp_share.items, 1, 0.0, cfg.max_response_len, seed=seed)
            baselines = [c["overall"] for c in score(greedy[tp_share.start :][:k], cfg, judge)]
        if engine.encoder is not None:  # the gathered features served this round's generation
            engine.encoder.whole = {}
        # sp_size > 1: the SP group's rollouts, each rank with its run of the pixel rows
        if layout.sp_size > 1:
            if not group_prompts:  # after generation: vLLM's own copies freed first
                group_prompts = sp.group_runs(shared, layout, processor)
            rollouts, baselines = sp.group_rollouts(rollouts, baselines, group_prompts, n, layout)
        else:  # the frames were the engine's alone: not held through the train phase
            bare = {id(r.prompt): replace(r.prompt, videos=[], images=[]) for r in rollouts}
            rollouts = [replace(r, prompt=bare[id(r.prompt)]) for r in rollouts]
        comps = score(rollouts, cfg, judge)  # one batch of judge requests a round
        for i, baseline in enumerate(baselines):
            scored = Group(rollouts[i * n : (i + 1) * n], comps[i * n : (i + 1) * n], baseline)
            group = swap_offline(scored, cfg, tok, eos_id, judge)
            if not cfg.dynamic_sampling or has_spread(group, cfg.dyn_filter_metric):
                kept.append(group)
            else:
                dropped.append(group)
        if not all_reduce([float(len(kept) < need)])[0]:  # all ranks take the same number of rounds
            break
    refilled = max(0, need - len(kept))
    return Batch(
        groups=(kept + dropped[:refilled])[:need],
        skips=skips,
        rounds=gen_round + 1,
        dropped=len(dropped),
        refilled=refilled,
    )


def global_rows(groups: list[Group], layout: sp.Layout) -> tuple[dict, int]:
    """Per-row values of the global batch, data-parallel ranks in rank order (an SP group's rows
    once), and where this rank's rows start. One gather: advantages and metrics read them."""
    rollouts = [r for g in groups for r in g.rollouts]
    mine = {
        "reward": [c["overall"] for g in groups for c in g.components],
        "components": [c for g in groups for c in g.components],
        "baseline": [g.baseline for g in groups for _ in g.rollouts],
        "finish": [r.finish for r in rollouts],
        "length": [len(r.response_ids) for r in rollouts],
        "id": [r.prompt.sample["id"] for r in rollouts],
        "type": [rewards.canonical_type(r.prompt.sample["problem_type"]) for r in rollouts],
    }
    parts = layout.dedup(gather(mine))
    start = sum(len(p["reward"]) for p in parts[: layout.dp_rank])
    return {k: [x for p in parts for x in p[k]] for k in mine}, start


# --------------------------------------------------------------------------------------------------
# main and its parts: setup, the train phase (log-prob pass, update), logging, the end of the run


def fsdp_choice(cfg: Config, params: int, memory: float, cuda: bool, world: int):
    """cfg.fsdp, or auto's: on several ranks without offload, where whole fp32 weights, gradients,
    AdamW moments and summed gradients (20 bytes a parameter, LoRA's frozen ones too) fit a quarter
    of a GPU's memory (CPU ranks: always), replicate on CPU and keep on CUDA (bf16 copies, where
    replicated parameters compute in fp32); else reshard."""
    if cfg.fsdp != "auto":
        return cfg.fsdp
    if world == 1 or cfg.offload or 20 * params > memory / 4:
        return "reshard"
    if cuda:
        return "keep"
    return "replicate"


def load_model(cfg: Config, device, value_head: bool = False):
    """HF model (LoRA: peft, base frozen), FSDP2-sharded per decoder layer and vision block, fp32
    master weights, bf16 compute on GPU; activation checkpointing (module hooks) before FSDP.
    value_head: the critic's, a trained Linear(D, 1) in the root's unit (LoRA: beside adapters)."""
    from torch.distributed._composable import checkpoint as checkpoint_module
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )
    from transformers import AutoModelForImageTextToText

    cuda = device.type == "cuda"
    attn = "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    model = AutoModelForImageTextToText.from_pretrained(
        cfg.model,
        config=common.hf_config(cfg.model, cfg.trust_remote_code),
        dtype=torch.float32,
        attn_implementation=attn,
        trust_remote_code=cfg.trust_remote_code,
    ).to(device)
    visual = sp.vision_tower(model)  # before peft wraps the model (PeftModel.model is another)
    towers = [visual]
    blocks = list(visual.blocks)
    if hasattr(model, "audio_tower"):  # Omni: frozen or trained with the vision tower, as it is
        towers.append(model.audio_tower)
        blocks += list(model.audio_tower.layers)
        # its forward projects every position (no logits_to_keep): the last one only
        model.lm_head.register_forward_pre_hook(lambda module, args: (args[0][:, -1:],))
    for tower in towers:
        tower.requires_grad_(not cfg.freeze_vision)
    layers = list(sp.language_model(model).layers)
    blocks = layers + blocks
    if cfg.gradient_checkpointing:  # a frozen tower runs without gradient: nothing to recompute
        for block in layers if cfg.freeze_vision else blocks:
            checkpoint_module(block)
    if cfg.sp_size > 1:
        sp.use_ulysses(model)
    if cfg.lora_rank:  # before fully_shard, which shards the frozen base and the adapters alike
        import re

        from peft import LoraConfig, get_peft_model

        # full names, the regex resolved here: peft 0.21 rewrites a regex over a model whose checkpoint
        # layout transformers converts (Qwen3-Omni's per-expert weights) into bare leaf names, adapting
        # every q_proj (its audio tower's too) and the fused experts, which the weight sync cannot merge
        targets = [n for n, _ in model.named_modules() if re.fullmatch(cfg.lora_targets, n)]
        if not targets:
            raise UserError(f"lora_targets {cfg.lora_targets!r} matches no module of {cfg.model}")
        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=targets,
        )
        model = get_peft_model(model, lora)
    if value_head:  # every rank draws the same weights (fully_shard keeps its shard of them)
        head = torch.nn.Linear(model.get_output_embeddings().weight.shape[1], 1, device=device)
        gen = torch.Generator(device).manual_seed(cfg.seed)
        torch.nn.init.normal_(head.weight, std=0.02, generator=gen)  # transformers' init range
        torch.nn.init.zeros_(head.bias)
        model.value_head = head
        lm_head = model.get_output_embeddings().weight
        if lm_head is not model.get_input_embeddings().weight:  # unused, not tied: no AdamW state
            lm_head.requires_grad_(False)
    world = dist.get_world_size() if dist.is_initialized() else 1
    memory = math.inf
    if cuda:
        memory = torch.cuda.get_device_properties(device).total_memory
    mode = fsdp_choice(cfg, sum(p.numel() for p in model.parameters()), memory, cuda, world)
    # one CPU process gains nothing from FSDP2 (no CPU mixed precision), and a process group exists
    # without torchrun (vLLM's in-process engine): shard on several ranks, or on a GPU for bf16
    if dist.is_initialized() and (world > 1 or cuda) and mode != "replicate":
        mp = MixedPrecisionPolicy()
        if cuda:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy() if cfg.offload else OffloadPolicy()  # CPU: shards, AdamW step
        after = None  # FSDP2's default: each unit resharded after forward, the root kept
        if mode == "keep":
            after = False
        for module in blocks + towers + [model]:  # a layer/block per gather unit; root: the rest
            fully_shard(module, mp_policy=mp, offload_policy=offload, reshard_after_forward=after)
        # the vision tower (own unit) runs before the root's forward: the root is set up first
        model._get_fsdp_state()._lazy_init()
    return model


# --------------------------------------------------------------------------------------------------
# The critic (adv_estimator gae): the policy's architecture with a scalar head, its own AdamW


@dataclass
class Critic:
    """PPO's value model: load_model's copy of cfg.model (FSDP2 like the policy; LoRA: adapters on
    its own frozen base) with value_head on the last hidden state; the lm_head is unused."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer  # AdamW, critic_lr


def build_critic(cfg: Config, device) -> Critic:
    model = load_model(cfg, device, value_head=True).eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    betas = (0.9, 0.99)
    return Critic(model, torch.optim.AdamW(trainable, lr=cfg.critic_lr, betas=betas))


def token_values(model, batch: MicroBatch, layout=None, counts: Counts | None = None):
    """The critic's value of each response token's state (b, R): value_head on the hidden state
    that predicts the token, as verl's critic reads values[:, -R - 1 : -1]. The critic's own tower
    encodes the media (batch.vision holds the policy's)."""
    hidden, shard = response_hidden(model, replace(batch, vision=None), layout, counts)
    values = model.value_head(hidden).squeeze(-1).float()  # (b, r)
    return shard.gather(values, batch.mask.shape[1])


def value_micro_loss(model, b: MicroBatch, cfg: Config, layout=None, counts=None):
    """This micro-batch's share of its mini-batch's value loss (as micro_loss's, loss_agg) and
    its metric sums: clipped tokens, values."""
    vpred = token_values(model, b, layout, counts)  # (b, R)
    vf, clipped = value_loss(vpred, b.values, b.returns, cfg.cliprange_value)
    loss = agg_loss(vf, b.mask, cfg.loss_agg, b.n_tok, b.n_seq, cfg.max_response_len)
    sums = {"vf_clipfrac": clipped, "vf_values": vpred.detach()}
    return loss, {k: (v * b.mask).sum().item() for k, v in sums.items()}


def critic_update(
    c: Critic, minibatches: list, cfg: Config, layout, step: int, ids: list, counts: Counts
) -> dict:
    """verl's update_critic: ppo_epochs x mini_batches steps on value_loss, aggregated as the
    policy's loss (loss_agg). Returns the first epoch's sums (vf_*) and the mean grad norm."""
    m = {}
    gnorms = []
    c.model.train()
    for epoch in range(cfg.ppo_epochs):
        for mini in minibatches:
            loss_sum = 0.0
            for b in mini:
                loss, sums = value_micro_loss(c.model, b, cfg, layout, counts)
                (loss * layout.world).backward()  # FSDP averages gradients over ranks
                loss_sum += loss.item()
                if epoch == 0:
                    add_metrics(m, sums)
            gnorms.append(optimizer_step(c.opt, loss_sum, cfg, step, ids, layout.rank))
            if epoch == 0:
                add_metrics(m, {"vf_loss": loss_sum / len(minibatches)})
    c.model.eval()
    return m | {"vf_grad_norm": mean_or_zero(gnorms)}


class StepFeatures(sp.FeatureCache):
    """vllm_embeds: the features of the prompts vLLM generated from, from generation to logp_pass,
    which empties it (the oldest dropped over 8 GiB: logp_pass encodes them again), kept per
    prompt's processor outputs (Prompt.mm: a held-out and a training sample may share an id and
    grid, not their pixels; the frameless copy sample_batch makes after generation shares them)."""

    def key(self, p, kind: str, grid: str) -> tuple:
        return (id(p.mm), *super().key(p, kind, grid))


@dataclass
class Trainer:
    """The training side of a run (build_trainer): policy, reference, optimizer, ranks."""

    model: torch.nn.Module
    ref: torch.nn.Module | None  # frozen reference (kl_coef > 0); LoRA: None, adapters scaled to 0
    opt: torch.optim.Optimizer  # AdamW over the trainable parameters (LoRA: the adapters only)
    banned: list[int]  # vision token ids: never sampled, masked in every log-prob
    layout: sp.Layout  # this rank's place: rank, world, its SP and TP groups
    dummies: dict | None  # FSDP (world > 1): a dummy row per modality a micro-batch lacks
    device: torch.device
    # the reference tower's features per sample (it is frozen: they never change)
    ref_features: sp.FeatureCache = field(default_factory=sp.FeatureCache)
    # vllm_embeds: the frozen tower's features that vLLM generated from, until logp_pass reads them
    step_features: StepFeatures = field(default_factory=StepFeatures)
    sampled_encodes: int = 0  # FrozenEncoder's tower runs that logp_pass has not counted yet
    critic: Critic | None = None  # adv_estimator gae


def build_trainer(cfg: Config, processor, layout: sp.Layout, device) -> Trainer:
    model = load_model(cfg, device)
    ref = None
    if cfg.kl_coef > 0 and not cfg.lora_rank:
        ref = load_model(cfg, device).eval().requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    dummies = None
    if layout.world > 1:  # FSDP: the same modules run on every rank
        dummies = data.dummy_prompts(processor)
    banned = vision_token_ids(processor.tokenizer)
    t = Trainer(model, ref, opt, banned, layout, dummies, device)
    if cfg.feature_cache_dir and cfg.kl_coef > 0:
        stamp = reference_stamp(cfg, ref or model)
        t.ref_features = sp.FeatureCache(folder=cfg.feature_cache_dir, stamp=stamp)
    if cfg.adv_estimator == "gae":
        t.critic = build_critic(cfg, device)
    return t


def reference_stamp(cfg: Config, model) -> dict:
    """What the reference tower's features depend on besides the media files (its disk cache's key):
    a digest of its weights (LoRA: the base, adapters left out), the media settings, its dtype,
    device and attention kernel. FSDP2: every rank gathers each weight, in the same order."""
    digest = hashlib.sha256()
    visual = sp.vision_tower(model)
    for name, p in visual.named_parameters():
        if "lora_" in name:
            continue
        if hasattr(p, "full_tensor"):  # an FSDP2 shard
            p = p.full_tensor()
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy())
    media = {k: v for k, v in asdict(cfg.media()).items() if k not in ("cache_dir", "video_source")}
    return dict(
        weights=digest.hexdigest(),
        media=media,
        dtype=str(p.dtype),
        device=p.device.type,
        kernel=visual.config._attn_implementation,
    )


class FrozenEncoder:
    """vllm_embeds' encoder (VLLMEngine's): each prompt's features (modality -> its items'
    features, on the host) from the frozen tower, kept in t.step_features for logp_pass; the tower
    runs on the prompts not kept yet (FSDP2: a collective), counted in the step's logp_pass.
    rollout_tp > 1: a TP group's ranks pass the same prompts; each prompt is encoded once, by a
    rank that holds its pixels (the one that prepared it, sp.share_round: a step's prompt is its
    logp_pass's), and the group gathers."""

    def __init__(self, t: Trainer):
        self.t = t
        self.whole = {}  # sp_size > 1: id(a step's prompt) -> its features, gathered (prepare)

    def prepare(self, prompts: list, group: list):
        """sp_size > 1, before generation: the SP group's prompts (group_runs') through the tower,
        each rank its runs (kept for logp_pass), gathered over the group into each prompt's whole
        features (its runs in order) for the engine that generates it (share_prompts' `prompts`)."""
        t = self.t
        layout = t.layout
        with torch.no_grad():
            t.sampled_encodes += t.step_features.vision(
                t.model, group, t.device, layout, t.dummies
            ).encodes
        kept = t.step_features
        mine = [
            {
                kind: kept.pieces[kept.key(p, kind, grid)]
                for kind, px, grid in sp.MEDIA
                if px in p.mm
            }
            for p in group
        ]
        parts = gather(mine, layout.host)
        index = layout.share(list(range(len(prompts))), layout.sp_size).items
        for k, i in enumerate(index):
            if prompts[i] is not None:  # its TP group's
                self.whole[id(prompts[i])] = {
                    kind: torch.cat([part[k][kind] for part in parts]) for kind in mine[k]
                }

    def __call__(self, prompts: list) -> list[dict]:
        layout = self.t.layout
        if all(id(p) in self.whole for p in prompts) and self.whole:  # prepared (SP)
            return [self.whole[id(p)] for p in prompts]
        if layout.tp == 1:
            return self.encode(prompts)
        held = gather([sp.holds_pixels(p) for p in prompts], layout.tp_host)
        mine = []
        for k, p in enumerate(prompts):
            holders = [q for q in range(layout.tp) if held[q][k]]
            if holders[k % len(holders)] == layout.rank % layout.tp:
                mine.append(k)
        encoded = dict(zip(mine, self.encode([prompts[k] for k in mine])))
        parts = gather(encoded, layout.tp_host)
        return [next(part[k] for part in parts if k in part) for k in range(len(prompts))]

    def encode(self, prompts: list) -> list[dict]:
        """The features of `prompts`, each one's whole (on this rank alone, SP or not)."""
        t = self.t
        with torch.no_grad():
            vision = t.step_features.vision(t.model, prompts, t.device, None, t.dummies)
        t.sampled_encodes += vision.encodes
        out = [{} for _ in prompts]
        for kind, pixels, grid in sp.MEDIA:
            for p, kept in zip(prompts, out):
                if pixels in p.mm:  # the prompt's features one after another
                    start = vision.kinds[kind].spans[id(p)]
                    count = sp.run_features(t.model, p, grid, 1)[-1]
                    kept[kind] = vision.kinds[kind].local[start : start + count].cpu()
        return out

    def new_step(self):
        """Drops what the held-out evaluation's generation kept, uncounted (not the step's)."""
        self.t.step_features = StepFeatures()
        self.t.sampled_encodes = 0
        self.whole = {}


def start_engine(cfg: Config, t: Trainer, tok, eos_ids: list[int], samples: dict):
    """The sampler: a colocated vLLM engine with the trainer's weights, or HF generate."""
    if cfg.rollout == "hf" or (cfg.loss_type == "sft" and not samples["val"]):  # SFT: eval only
        return HFEngine(t.model, tok, eos_ids, t.dummies)
    every = samples["train"] + samples["val"]
    images = [len(s.get("images", [])) for s in every]
    videos = [len(s.get("videos", [])) for s in every]
    encoder = None  # vLLM encodes the pixels
    if cfg.vllm_embeds:
        encoder = FrozenEncoder(t)
    # the trainer's compute dtype: vLLM's "auto" would downcast an fp32 checkpoint to bf16 on CPU
    engine = VLLMEngine(
        cfg.model,
        tok,
        tp=cfg.rollout_tp,
        max_model_len=cfg.max_model_len,
        dtype="bfloat16" if t.device.type == "cuda" else "float32",
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        sleep=cfg.vllm_sleep,
        seed=cfg.seed,
        trust_remote_code=cfg.trust_remote_code,
        max_images=max(images + [1]),
        max_videos=max(videos + [1]),
        encoder=encoder,
    )
    engine.sync(t.model)  # from the first step on, the engine and the trainer hold the same weights
    return engine


def load_data(cfg: Config, tok, template: str | None, skipped: list) -> dict:
    """{"train": samples, "val": at most eval_max_samples}; skip_invalid: invalid to `skipped`."""
    # the model's special tokens in any text field (<|image_pad|> is banned, <|im_end|> ends a turn)
    added = tuple(t.content for t in tok.added_tokens_decoder.values() if t.special)
    specials = data.SPECIAL_TOKENS + added
    load = functools.partial(
        data.load_samples,
        skip_invalid=cfg.skip_invalid,
        skipped=skipped,
        special_tokens=specials,
        allow_outside=cfg.allow_outside_media,
    )
    # SFT learns the reference response: a training sample without one is bad
    need = ""
    if cfg.loss_type == "sft":
        need = "offline_output"
    samples = {"train": load(cfg.train_data, need=need), "val": []}
    if cfg.val_data:
        samples["val"] = load(cfg.val_data)[: cfg.eval_max_samples]
    # every prompt rendered once, now, bounded in time and memory (render_prompt reuses the text)
    if template:
        report = skipped if cfg.skip_invalid else None
        for split, rows in samples.items():
            samples[split] = data.render_all(
                template, rows, cfg.response_format, report, where=cfg.prompt_template
            )
    if not samples["train"]:
        raise data.DataError(f"{cfg.train_data}: no valid training sample ({len(skipped)} skipped)")
    return samples


def preparers(cfg: Config, processor, template: str | None, stats: dict):
    """data.prepare for training prompts and for held-out ones (their own frame budget); both
    count cache hits and decodes into `stats`."""
    prep = functools.partial(
        data.prepare,
        processor=processor,
        media=cfg.media(),
        stats=stats,
        template=template,
        response_format=cfg.response_format,
        max_prompt_len=cfg.max_prompt_len,
    )
    return prep, functools.partial(prep, media=cfg.media(held_out=True))


def eval_row(sample: dict, prompt: str, response: str) -> dict:
    """One held-out row of out_dir/eval/step_N.jsonl (lmms-eval's fields): the training reward's
    accuracy rule on the response's answer text (rewards.answer_text); unreadable scores 0."""
    answer = rewards.answer_text(response)
    value = rewards.accuracy(answer, sample)
    read = None  # what was read: None when unreadable
    if value is not None:
        read = answer
    return {
        "doc_id": sample["id"],
        "input": prompt,
        "target": rewards.ground_truth(sample),
        "resps": [response],
        "filtered_resps": [read],
        "score": float(value or 0.0),
        "parse_fail": value is None,
        "problem_type": sample["problem_type"],
    }


def held_out_count(val: list[dict], skipped: list[dict]) -> int:
    """The held-out samples that prepare (the same on every rank): all but those a skip report names."""
    invalid = {report["where"] for report in skipped} & {s["id"] for s in val}
    return len(val) - len(invalid)


def held_out_accuracy(
    engine, samples: list, prep, cfg: Config, layout: sp.Layout, skipped: list, step: int = 0
) -> float:
    """Greedy held-out accuracy over all ranks, each TP group generating its ranks' parts of the
    samples a training round's worth at a time (data.held_out_rounds: one round's pixels held; each
    sample prepared by one rank, sp.share_round passing its frames to the group); the rows in
    out_dir/eval/step_N.jsonl, skip reports not yet in `skipped` appended to it. NaN without a row."""
    size = -(-cfg.prompts_per_step // layout.world)  # a rank's part of a training round
    own = replace(layout, tp=1)  # each rank prepares its own part; its engine takes its group's
    mine = []
    skips = []
    for prompts in data.held_out_rounds(prep, samples, cfg.skip_invalid, own, size, skips):
        shared = sp.share_round(prompts, layout)
        # every rank generates as many prompts as the largest share: HF generate is collective
        longest = max(gather(len(shared.items)))
        if not longest:
            continue
        padded = shared.items + shared.items[:1] * (longest - len(shared.items))
        outs = engine.generate(
            padded, n=1, temperature=0.0, max_tokens=cfg.max_response_len, seed=cfg.seed
        )
        mine += [  # the rows of the prompts it prepared
            eval_row(r.prompt.sample, r.prompt.text, r.text)
            for r in outs[shared.start :][: shared.count]
            if r.prompt.sample.get("pad") is not data.PAD
        ]
    reported = {report["where"] for report in skipped}
    for part in gather(skips):
        skipped += [report for report in part if report["where"] not in reported]
    rows = [x for part in gather(mine) for x in part]
    if layout.rank == 0 and rows:
        common.write_jsonl(os.path.join(cfg.out_dir, "eval", f"step_{step}.jsonl"), rows)
    if not rows:
        return float("nan")
    # in percent and back, as evaluate.aggregate computed it: the same float in metrics.jsonl
    return 100 * sum(r["score"] for r in rows) / len(rows) / 100


def logp_pass(
    t: Trainer,
    minibatches: list[list[MicroBatch]],
    rollouts: list[Rollout],
    cfg: Config,
    counts: Counts,
):
    """No-grad old log-probs where the update is off-policy (epochs, mini-batches, KL in the
    reward), the reference's with kl_coef, into each micro-batch. Every prompt's features once for
    all of them (a frozen tower: for all passes); the reference's kept per sample
    (t.ref_features; a frozen tower: the policy's)."""
    on_policy = cfg.ppo_epochs == 1 and cfg.mini_batches == 1 or cfg.loss_type == "sft"
    need_old = not on_policy or cfg.kl_in_reward
    trains = sp.tower_trains(t.model)
    prompts = [r.prompt for r in rollouts]
    policy = None
    logp_args = (cfg.temperature, t.banned, cfg.logp_chunk, t.layout, counts)
    counts.encodes += t.sampled_encodes  # vllm_embeds: the step's encodes for generation
    t.sampled_encodes = 0
    with torch.no_grad():
        if cfg.vllm_embeds:  # the features vLLM generated from
            policy = t.step_features.vision(t.model, prompts, t.device, t.layout, t.dummies)
            counts.encodes += policy.encodes
            t.step_features = StepFeatures()
        elif need_old or not trains:
            policy = sp.encode_vision(t.model, prompts, t.device, t.layout, t.dummies)
            counts.encodes += policy.encodes
        ref = policy
        if cfg.kl_coef > 0 and trains:
            with as_reference(t.model, t.ref) as m:
                ref = t.ref_features.vision(m, prompts, t.device, t.layout, t.dummies)
            counts.encodes += ref.encodes
        for b in itertools.chain(*minibatches):
            b.vision = policy
            if need_old:
                b.old_logp = token_logp(t.model, b, *logp_args)[0]
            if cfg.kl_coef > 0:
                with as_reference(t.model, t.ref) as m:
                    b.ref_logp = token_logp(m, replace(b, vision=ref), *logp_args)[0]
            if t.critic is not None:
                b.values = token_values(t.critic.model, b, t.layout, counts)


def add_metrics(total: dict, metrics: dict):
    """Sums a micro-batch's metrics into total (mismatch_max: the maximum)."""
    for k, v in metrics.items():
        if k == "mismatch_max":
            total[k] = max(total.get(k, 0.0), v)
        else:
            total[k] = total.get(k, 0.0) + v


def update(
    t: Trainer,
    minibatches: list[list[MicroBatch]],
    cfg: Config,
    step: int,
    ids: list,
    counts: Counts | None = None,
) -> dict:
    """ppo_epochs x mini_batches optimizer steps: backward over the micro-batches, grad clip, a stop
    on every rank before the step when a loss or grad norm is not finite (naming the samples, ids).
    Returns the first epoch's metric sums over this rank's micro-batches and the mean grad_norm."""
    for group_param in t.opt.param_groups:
        group_param["lr"] = lr_at(step - 1, cfg)
    m = {}
    gnorms = []
    trains = sp.tower_trains(t.model)  # else the features of logp_pass serve every pass
    t.model.train()  # only lora_dropout acts in train mode (Qwen-VL has no other dropout)
    for epoch in range(cfg.ppo_epochs):
        for mini in minibatches:
            loss_sum = 0.0
            # a trained tower: each prompt once, its feature gradient summed over its micro-batches
            towers = sp.Towers(t.model, [b.prompts for b in mini], t.device, t.layout, t.dummies)
            for i, b in enumerate(mini):
                if trains:
                    b.vision = towers.vision(i)
                loss, metrics = micro_loss(t.model, b, cfg, t.banned, t.layout, counts)
                # FSDP averages gradients over ranks: x world sums them
                (loss * t.layout.world).backward()
                towers.backward(i)
                loss_sum += metrics["loss"]
                if epoch == 0:  # the first pass's metrics
                    add_metrics(m, metrics)
            if counts is not None:
                counts.encodes += towers.encodes
            # gae's critic warm-up: the policy's loss and gradient are measured, not applied
            apply = step > cfg.critic_warmup
            gnorms.append(optimizer_step(t.opt, loss_sum, cfg, step, ids, t.layout.rank, apply))
    t.model.eval()
    m["loss"] /= len(minibatches)
    return m | {"grad_norm": mean_or_zero(gnorms)}


def optimizer_step(
    opt, loss_sum: float, cfg: Config, step: int, ids: list, rank: int, apply: bool = True
) -> float:
    """Gradients and losses summed over ranks (sum_grads), grad clip and (apply) the step, unless
    the loss or grad norm is not finite on any rank: then every rank stops before it, naming the
    samples (ids). Returns the grad norm."""
    params = opt.param_groups[0]["params"]
    loss = sum_grads(params, loss_sum)
    gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
    if not math.isfinite(loss + gnorm):
        raise FloatingPointError(
            f"step {step}: the loss ({loss_sum} on rank {rank}) or the grad norm "
            f"({gnorm}) is not finite; samples {ids}: stopped before the update"
        )
    if apply:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return gnorm


def sum_grads(params: list, loss_sum: float) -> float:
    """The ranks' losses summed. Replicated parameters (fsdp replicate) on several ranks: in one
    all-reduce with their gradients (/ world: FSDP2 averages, losses are x world); a parameter no
    rank has a gradient for keeps none. FSDP2 reduced its gradients in backward."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or hasattr(params[0], "to_local"):
        return all_reduce([loss_sum])[0]
    has = [float(p.grad is not None) for p in params]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch.cat([g.flatten() for g in grads] + [params[0].new_tensor(has + [loss_sum])])
    dist.all_reduce(flat)
    *parts, summed = flat.split([p.numel() for p in params] + [len(params) + 1])
    for p, part, any_grad in zip(params, parts, summed.tolist()):
        if any_grad:
            p.grad = part.view_as(p).div_(dist.get_world_size())
    return summed[-1].item()


@dataclass
class Phase:
    """What train_phase did: the update's metrics and the advantages it trained on."""

    metrics: dict  # update's sums, kl (KL in the reward: the old-vs-ref KL too), vision_encodes
    adv_all: torch.Tensor  # (B_all, max_response_len) every rank's rows (global_rows' order)
    adv: torch.Tensor  # (B, max_response_len) this rank's rows, on its device


def train_phase(
    t: Trainer,
    rollouts: list[Rollout],
    rows: dict,
    start: int,
    cfg: Config,
    tok,
    step: int,
    ids: list,
) -> Phase:
    """A step after generation: micro-batches, the no-grad old/ref log-prob pass, KL in the reward,
    advantages of the global batch (rows: global_rows', this rank's from `start`), the optimizer
    steps. The step's micro-batches and features end with it."""
    counts = Counts()
    minibatches = micro_batches(rollouts, cfg, tok, t.device, t.dummies, rows["length"])
    logp_pass(t, minibatches, rollouts, cfg, counts)
    batches = list(itertools.chain(*minibatches))
    mine = slice(start, start + len(rollouts))  # this rank's rows
    kl_all = None
    kl = 0.0
    if cfg.kl_in_reward:  # verl apply_kl_penalty, old log-probs (check_config: kl_coef > 0)
        per_token = [kl_penalty(b.old_logp, b.ref_logp, cfg.kl_type) * b.mask for b in batches]
        kl_all = global_tokens(per_token, cfg, t.layout)  # (B_all, R)
        kl = kl_all[mine].sum().item()
    m = {}
    if t.critic is not None:  # gae: advantages and returns from the values, the critic's steps
        values_all = global_tokens([b.values for b in batches], cfg, t.layout)  # (B_all, R)
        adv_all, returns_all = gae_batch(rows, values_all, kl_all, cfg)
        returns = returns_all[mine].float().to(t.device)
        for b in batches:
            b.returns = returns[b.index, : b.mask.shape[1]]
        m = critic_update(t.critic, minibatches, cfg, t.layout, step, ids, counts)
    else:
        kl_to_go = None
        if kl_all is not None:
            kl_to_go = cfg.kl_coef * reward_to_go(kl_all)
        adv_all = batch_advantages(rows, kl_to_go, cfg)  # (B_all, max_response_len)
    adv = adv_all[mine].float().to(t.device)
    for b in batches:
        b.adv = adv[b.index, : b.mask.shape[1]]
    m |= update(t, minibatches, cfg, step, ids, counts)
    m["kl"] = kl + m["kl"]
    m["vision_encodes"] = counts.encodes
    return Phase(m, adv_all, adv)


def log_step(
    row: dict,
    parts: list[dict],
    cfg: Config,
    layout: sp.Layout,
    logger,
    skipped: list,
    per_step: float,
):
    """Rank 0: the step's line on stdout, samples.jsonl, metrics.jsonl, wandb, skipped.jsonl."""
    step = row["step"]
    if row["data/skipped_step"]:
        common.write_jsonl(os.path.join(cfg.out_dir, "skipped.jsonl"), skipped)
    eta = datetime.timedelta(seconds=round(per_step * (cfg.max_steps - step)))
    shown = [f"{k} {v:.4g}" for k, v in row.items() if k in LOG_KEYS]
    line = [f"step {step}/{cfg.max_steps}", *shown, f"{per_step:.3g} s/step | ETA {eta}"]
    print0(" | ".join(line))
    shared = [x for p in layout.dedup(parts) for x in p["samples"]]  # an SP group's once
    write_samples(shared[: cfg.log_samples], cfg, logger, step)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    logger.log(row, step=step)


def save_step(cfg: Config, step: int, t: Trainer, processor, stream: data.Stream, meta: dict):
    """A checkpoint of the step: model, optimizer, processor and meta (the run's state) with the
    data stream's position."""
    position = {"epoch": stream.epoch, "cursor": stream.cursor}
    never_stepped = not t.opt.state  # gae's critic warm-up
    meta = dict(step=step, data=position, config=asdict(cfg)) | meta
    ckpt.save(
        cfg.out_dir,
        step,
        t.model,
        t.opt,
        processor,
        meta=meta,
        keep_last=cfg.keep_last,
        rank=t.layout.rank,
        critic=t.critic,
    )
    if never_stepped:  # DCP's get_state_dict made AdamW state with a zero-gradient step: drop it
        t.opt.state.clear()
    print0(f"step {step}: checkpoint {os.path.join(cfg.out_dir, 'ckpt', f'step_{step:08d}')}")


def finish(
    cfg: Config,
    t: Trainer,
    processor,
    engine,
    logger,
    acc_before: float,
    acc_after: float,
    trained: bool,
):
    """The run's end: curve and summary.json (trained: this process trained), final checkpoint."""
    catch_stop_signals(catch=False)  # the end of the run: no step to finish
    if t.layout.rank == 0 and trained:
        rows = common.curve_rows(os.path.join(cfg.out_dir, "metrics.jsonl"), acc_before)
        curves = [
            ("reward/mean", "-", "train reward"),
            ("reward/accuracy", "-", "train accuracy"),
            ("eval/accuracy", "o-", "held-out accuracy (greedy)"),
        ]
        lines = []
        for key, style, label in curves:
            have = [r for r in rows if key in r]
            lines.append(([r["step"] for r in have], [r[key] for r in have], style, label))
        common.plot(lines, os.path.join(cfg.out_dir, "curve.png"))
        summary = {"acc_before": acc_before, "acc_after": acc_after, "config": asdict(cfg)}
        common.write_text(os.path.join(cfg.out_dir, "summary.json"), json.dumps(summary, indent=1))
    if cfg.save:
        final = os.path.join(cfg.out_dir, "final")
        ckpt.save_checkpoint(t.model, processor, final, t.layout.rank, cfg.model)
    print0(f"held-out accuracy: before {acc_before:.2f} after {acc_after:.2f}")
    logger.finish()
    engine.close()  # now: a next run in this process (a notebook) builds its own engine
    barrier()
    return acc_before, acc_after


def main(cfg: Config):
    world, device = init_dist(cfg.dist_timeout, cfg.offload)[1:]  # (rank, world, device)
    if cfg.world and not cfg.dry_run:
        raise UserError(
            f"world {cfg.world} is --dry-run's: a run's world is its launch's ({world})"
        )
    check_config(cfg, cfg.world or world)
    ckpt_path = ckpt.find(cfg.out_dir, cfg.resume)
    check_files(cfg, ckpt_path)
    common.check_hub(cfg.model)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    tok = processor.tokenizer
    template = None
    if cfg.prompt_template:
        template = open(cfg.prompt_template).read()
    skipped: list = []  # every skip report of the run, written to out_dir/skipped.jsonl
    samples = load_data(cfg, tok, template, skipped)
    if cfg.dry_run:
        return dry_run(cfg, processor, template, samples, skipped)
    # the settings and data are checked: the ranks' work (and errors) differ from here
    common.ERRORS["per_rank"] = True
    layout = sp.make_layout(cfg.sp_size, cfg.rollout_tp)  # an SP group trains the same rows
    t = build_trainer(cfg, processor, layout, device)
    state = {}
    if ckpt_path:  # before the engine gets the weights
        state = ckpt.load(ckpt_path, t.model, t.opt, t.critic)
        if state["step"] <= cfg.critic_warmup:  # the policy never stepped: save_step's state
            t.opt.state.clear()
    first_step = state.get("step", 0) + 1
    eos_ids = eos_token_ids(t.model)
    engine = start_engine(cfg, t, tok, eos_ids, samples)  # SFT: the held-out evaluation's
    sampler = engine
    if cfg.loss_type == "sft":
        sampler = OfflineEngine(tok, eos_ids[0])
    catch_stop_signals(catch=False)  # after the engine (ours are the handlers): a signal ends it
    # the media counters (cache.py's), each logged from the first step on
    counters = "cache_hit cache_miss cache_corrupt cache_unwritable decode decode_s audio_clipped audio_missing"
    stats = dict.fromkeys(counters.split(), 0)
    prep, val_prep = preparers(cfg, processor, template, stats)
    judge = None
    if cfg.judge_url:
        judge = rewards.Judge(cfg, open(cfg.judge_template).read())
    skipped = state.get("skipped", skipped)  # resumed: the saved report has load/val skips
    acc_before = state.get("acc_before", float("nan"))
    acc_after = state.get("acc_after", float("nan"))  # after the last step (evaluated in the loop)
    if state:
        print0(f"resumed from {ckpt_path} (step {state['step']})")
    elif samples["val"]:
        acc_before = held_out_accuracy(engine, samples["val"], val_prep, cfg, layout, skipped)
    n_val = held_out_count(samples["val"], skipped)
    print0(
        f"step 0 | held-out accuracy {acc_before:.3f} | {len(samples['train'])} train, {n_val} val, "
        f"{len(skipped)} skipped | world {world}, sp_size {cfg.sp_size} | rollout {cfg.rollout} tp={cfg.rollout_tp}"
    )
    # the same order on every rank; the position (epoch, cursor) is saved in every checkpoint
    stream = data.Stream(len(samples["train"]), cfg.seed, **state.get("data", {}))
    with common.writing(0, cfg.out_dir):
        logger = start_logs(cfg, state, skipped, layout.rank)
    if first_step > cfg.max_steps:
        print0(
            f"{ckpt_path} is at step {state['step']}: max_steps {cfg.max_steps} reached, nothing to "
            "train"
        )
    t_start = time.time()
    where = {}  # the step and its samples, for a stuck step's report
    signals = catch_stop_signals(grace_s=cfg.stop_grace_s, where=where)  # 1st: save at the end
    for step in range(first_step, cfg.max_steps + 1):
        where.update(step=step, ids="not drawn yet")
        t0 = time.time()
        stats_before = dict(stats)
        n_skipped = len(skipped)
        # ------------------------------------------------- sample, reward (+ DAPO dynamic sampling)
        batch = sample_batch(
            sampler, stream, samples["train"], prep, cfg, step, tok, eos_ids[0], layout, judge
        )  # scored as generated
        skipped += batch.skips
        engine.sleep()
        t_gen = time.time() - t0
        rollouts = [r for g in batch.groups for r in g.rollouts]
        rows, start = global_rows(batch.groups, layout)  # every rank's rows: advantages and metrics
        if judge is not None:  # every rank sees the same rows: all stop, or none
            rewards.check_judge(rows["components"], cfg.judge_max_fail, f"step {step}", judge)
        ids = rows["id"][:: cfg.group_size]
        where["ids"] = ids
        # ---------------------- old / ref log-probs (no grad, once), advantages, optimizer steps
        t1 = time.time()
        phase = train_phase(t, rollouts, rows, start, cfg, tok, step, ids)
        m = phase.metrics | dict(
            dyn_rounds=batch.rounds, dyn_dropped=batch.dropped, dyn_refilled=batch.refilled
        )
        # ---------------------------------------------------- sync
        t2 = time.time()
        periodic = cfg.eval_every and step % cfg.eval_every == 0
        evaluated = n_val and (step == cfg.max_steps or periodic)
        if cfg.loss_type != "sft" or evaluated:  # SFT: the engine samples only to evaluate
            engine.sync(t.model)
        times = dict(gen=t_gen, train=t2 - t1, sync=time.time() - t2, step=time.time() - t0)
        # ---------------------------------------------------- log
        stats_step = {k: stats[k] - stats_before[k] for k in stats}
        shown = sample_rows(batch.groups, phase.adv, step, cfg)
        parts = gather({"m": m, "stats": stats_step, "samples": shown})
        adv_all = phase.adv_all
        # the step's prompts (pixels) must not live through the evaluation or the next rollout
        del batch, rollouts, phase
        if evaluated:  # the result of the run, once the last step has run
            acc_after = held_out_accuracy(
                engine, samples["val"], val_prep, cfg, layout, skipped, step=step
            )
        if layout.rank == 0:
            row = step_metrics(rows, adv_all, parts, step, cfg, times, layout)
            row["data/skipped"] = len(skipped)
            row["data/skipped_step"] = len(skipped) - n_skipped
            row["data/ids"] = ids
            if evaluated:
                row["eval/accuracy"] = acc_after
            per_step = (time.time() - t_start) / (step - first_step + 1)
            with common.writing(step, cfg.out_dir):
                log_step(row, parts, cfg, layout, logger, skipped, per_step)
        # ---------------------------------------------------- checkpoint / preemption
        stop = any_rank(bool(signals))
        if stop or (cfg.save_every and step % cfg.save_every == 0):
            run = dict(
                wandb_id=logger.id, acc_before=acc_before, acc_after=acc_after, skipped=skipped
            )
            with common.writing(step, os.path.join(cfg.out_dir, "ckpt")):
                save_step(cfg, step, t, processor, stream, run)
        if stop:
            print0(f"step {step}: stop signal {signals}: checkpoint saved, exiting")
            engine.close()
            return acc_before, float("nan")
    trained = first_step <= cfg.max_steps  # this process trained a step
    with common.writing(cfg.max_steps, cfg.out_dir):
        return finish(cfg, t, processor, engine, logger, acc_before, acc_after, trained)


# --------------------------------------------------------------------------------------------------
# Metrics and logging


class NoLogger:
    """Stands in for a wandb run when wandb is off."""

    id = None

    def log(self, row: dict, step: int):
        pass

    def finish(self):
        pass


def trim_rows(path: str, last_step: int):
    """Keep a JSONL log's rows up to last_step: a fresh run keeps none of an earlier run's, a
    resumed one drops steps its checkpoint lacks (trained again). Dropped rows are reported."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = f.readlines()
    kept = [r for r in rows if r.endswith("\n") and json.loads(r)["step"] <= last_step]  # else torn
    if len(kept) < len(rows):
        print(f"{path}: {len(rows) - len(kept)} rows past step {last_step} (earlier run's) removed")
        common.write_text(path, "".join(kept))


def sample_rows(groups: list[Group], adv: torch.Tensor, step: int, cfg: Config) -> list[dict]:
    """Every log_every steps, the first completion of this rank's first log_samples groups, its
    reward components and advantage (at its first token: per-token estimators vary along it)."""
    if not cfg.log_every or step % cfg.log_every:
        return []
    return [
        {
            "step": step,
            "id": g.rollouts[0].prompt.sample["id"],
            "response": g.rollouts[0].text,
            "finish": g.rollouts[0].finish,
            "reward": g.components[0],
            "advantage": adv[i * cfg.group_size, 0].item(),
        }
        for i, g in enumerate(groups[: cfg.log_samples])
    ]


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


def start_logs(cfg: Config, state: dict, skipped: list, rank: int):
    """Rank 0's logs at the start: skipped.jsonl (atomic; training-time skips later), metrics and
    samples trimmed to the checkpoint's step (else two runs' curves mix), and the wandb run (resumed
    by id), online, offline or disabled as `wandb login` and WANDB_MODE say."""
    if rank == 0:
        common.write_jsonl(os.path.join(cfg.out_dir, "skipped.jsonl"), skipped)
        for name in ("metrics.jsonl", "samples.jsonl"):
            trim_rows(os.path.join(cfg.out_dir, name), state.get("step", 0))
    if rank or not cfg.wandb_project:
        return NoLogger()
    import wandb

    return wandb.init(
        project=cfg.wandb_project,
        config=asdict(cfg),
        dir=cfg.out_dir,
        id=state.get("wandb_id"),
        resume="allow",
    )


LOG_KEYS = (
    "reward/mean reward/accuracy reward/format reward/parse_fail len/mean loss clipfrac entropy "
    "grad_norm mismatch/mean eval/accuracy time/step time/gen time/train tokens/s"
).split()


def mean_or_zero(xs: list) -> float:
    """The mean of xs, 0 for none."""
    return sum(xs) / max(1, len(xs))


def step_metrics(
    rows: dict,
    adv: torch.Tensor,
    parts: list[dict],
    step: int,
    cfg: Config,
    times: dict,
    layout: sp.Layout,
) -> dict:
    """Global metrics: exact means over every row (global_rows, adv (B_all, R)) and every rank's
    sums (parts), an SP group's once, but each rank's own work (encodes, cache counters)."""
    shared = layout.dedup(parts)
    msum = {k: sum(p["m"][k] for p in shared) for k in parts[0]["m"]}
    rew = rows["reward"]
    comp = rows["components"]
    types = rows["type"]
    n_tok = sum(rows["length"])
    off = [f == "offline" for f in rows["finish"]]
    row = {
        "step": step,
        "reward/mean": mean_or_zero(rew),
        "lr": lr_at(step - 1, cfg),
        "grad_norm": parts[0]["m"]["grad_norm"],  # the same on every rank
        "loss": msum["loss"],
        "clipfrac": msum["clipfrac"] / n_tok,
        "entropy": msum["entropy"] / n_tok,
        "kl": msum["kl"] / n_tok,
        "mismatch/mean": msum["mismatch_sum"] / max(1.0, msum["mismatch_n"]),
        "mismatch/max": max(p["m"]["mismatch_max"] for p in parts),
        "router/aux": msum["router_aux"],
        "len/mean": mean_or_zero(rows["length"]),
        "len/truncated": mean_or_zero([f == "length" for f in rows["finish"]]),
        "tokens/s": n_tok / times["step"],
        "vision/encodes": sum(p["m"]["vision_encodes"] for p in parts),
        "dyn/rounds": parts[0]["m"]["dyn_rounds"],
        "dyn/dropped": msum["dyn_dropped"],
        "dyn/refilled": msum["dyn_refilled"],
    }
    keys = ("accuracy", "format", "parse_fail", "overlong", *rewards.JUDGE_KEYS)
    for key in [k for k in keys if k in comp[0]]:
        row[f"reward/{key}"] = mean_or_zero([c[key] for c in comp])
        for t in sorted(set(types)):
            of_type = [c[key] for c, ty in zip(comp, types) if ty == t]
            row[f"reward/{key}/{t}"] = mean_or_zero(of_type)
    groups = [rew[i : i + cfg.group_size] for i in range(0, len(rew), cfg.group_size)]
    row["zero_std_groups"] = mean_or_zero([float(max(x) == min(x)) for x in groups])
    if cfg.tis:
        row["tis/weight"] = msum["tis_weight"] / n_tok
        row["tis/clipped"] = msum["tis_clipped"] / n_tok
    if cfg.adv_estimator == "remax":
        row["reward/greedy"] = mean_or_zero(rows["baseline"])
    if cfg.adv_estimator == "gae":
        row["critic/vf_loss"] = msum["vf_loss"]
        row["critic/vf_clipfrac"] = msum["vf_clipfrac"] / n_tok
        row["critic/values"] = msum["vf_values"] / n_tok
        row["critic/grad_norm"] = parts[0]["m"]["vf_grad_norm"]
    if any(off):
        first_adv = adv[:, 0].tolist()
        row["offline/share"] = mean_or_zero(off)
        row["offline/reward"] = mean_or_zero([r for r, o in zip(rew, off) if o])
        row["offline/adv"] = mean_or_zero([a for a, o in zip(first_adv, off) if o])
        row["online/reward"] = mean_or_zero([r for r, o in zip(rew, off) if not o])
    for k in parts[0]["stats"]:
        row[f"cache/{k}"] = sum(p["stats"][k] for p in parts)
    for k, v in times.items():
        row[f"time/{k}"] = v
    return row


if __name__ == "__main__":
    common.cli(main, load_config, error_log=True)

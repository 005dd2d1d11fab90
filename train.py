"""train.py: GRPO for video (and image) VLMs, in one file you read top to bottom.

    python train.py --config configs/tiny_cpu.yaml                              # one process
    torchrun --nproc_per_node=2 train.py --config configs/tiny_cpu.yaml         # this CPU (gloo)
    torchrun --nproc_per_node=8 train.py --config configs/qwen2_5_vl_7b.yaml    # one 8-GPU node (nccl)

Every rank runs the same loop (SPMD, no controller): FSDP2 shards the policy, a vLLM engine lives in
the same process (rollout.py) and gets the new weights after every optimizer step.

One step (section banners in main):
  sample     prompts_per_step prompts (global), group_size completions each; a sample's `offline_output`
             replaces the last rollout of its group; DAPO dynamic sampling drops all-equal groups and
             generates more rounds (sample_batch)
  reward     rewards.compute_reward -> (overall, components) + DAPO soft overlong penalty (score)
  log-probs  old (trainer, before the update) and reference log-probs, no grad, once per batch;
             optional KL-in-reward: r -= kl_coef * sum_t KL(old || ref)
  advantage  `advantages(..., estimator=)` on the GLOBAL batch (whitening estimators need every rank)
  loss       `policy_loss(..., loss_type=)` x optional truncated IS weight, `agg_loss(..., mode=)` with
             global token/sequence counts (micro-batch and rank splits do not change it), - entropy
             bonus, + KL loss; ppo_epochs x mini_batches optimizer steps per rollout batch
  step       AdamW, grad clipping, warmup + cosine schedule
  sync       weights -> vLLM, caches reset

The math follows verl 0.9.1 (../shared/reference/algorithms.md). Deviations, on purpose:
1. Outcome rewards only, gamma = 1: REINFORCE++ returns equal the sequence reward at every token, so its
   token-weighted batch whitening is computed from per-sequence values weighted by length (same value).
2. seq-mean-token-sum-norm divides by max_response_len (verl: the padded length of the micro-batch,
   which would make the loss depend on the split).
3. With ppo_epochs = mini_batches = 1 and no KL-in-reward, old_logp is the detached trainer logp
   (ratio = 1: the plain policy gradient), saving a forward pass.
4. The offline trajectory is treated as on-policy (its behaviour probabilities are unknown): ratio 1,
   IS weight 1.
5. Dynamic sampling never fails a step: after max_gen_rounds the batch is filled up with dropped
   (all-equal) groups, counted in dyn/refilled. The TIS mask mode drops weights above the cap only.
"""
import datetime
import itertools
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

import data
import evaluate
import rewards
from rollout import HFEngine, Rollout, VLLMEngine, mm_token_types, request_seed, vision_token_ids


@dataclass
class Config:
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
    prompt_template: str = ""
    """path to a Jinja2 template for the user prompt ('' = per-problem-type defaults in data.py)"""
    max_prompt_len: int = 4096
    """prompts longer than this (in tokens, vision included) are an error: never silently truncated"""
    # --- frames (separate budgets for video and image)
    video_fps: float = 2.0
    """frames sampled per second of video"""
    video_min_frames: int = 4
    """at least this many frames per video"""
    video_max_frames: int = 32
    """at most this many frames per video"""
    video_min_pixels: int = 3136
    """min pixels per frame (smart-resize lower bound)"""
    video_max_pixels: int = 100352
    """max pixels per frame"""
    video_total_pixels: int = 0
    """pixel budget over all frames of a video (0 = qwen-vl-utils' default: 128000 tokens, at most 768 per frame)"""
    image_min_pixels: int = 3136
    """min pixels per image"""
    image_max_pixels: int = 1003520
    """max pixels per image"""
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
    video_source: str = "prefer_cache"
    """prefer_cache | cache_only | decode_only (see cache.py)"""
    cache_dir: str = ".cache/frames"
    """frame cache folder ('' = no cache)"""
    # --- rollout
    rollout: str = "vllm"
    """vllm | hf (transformers generate on the training model)"""
    rollout_tp: int = 1
    """vLLM tensor parallel size: 1 = an engine per rank, world size = one engine over all ranks"""
    group_size: int = 8
    """completions per prompt (n)"""
    prompts_per_step: int = 8
    """prompts per optimizer step, over all ranks (divisible by world size)"""
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
    """threshold mode: swap only when the group's online accuracy (mean over its n rollouts) is below this
    (0 = always swap). The offline response is treated as on-policy: the probabilities of the policy that wrote it
    are unknown, so its ratio is taken against the trainer's own old_logp (1 in the first update) and its TIS
    weight is 1; its share, reward and advantage are logged apart as offline/*"""
    # --- reward
    w_acc: float = 0.9
    """weight of the accuracy reward"""
    w_fmt: float = 0.1
    """weight of the format reward"""
    format_template: str = "answer"
    """format reward template: answer (<answer>..</answer>) | think_answer"""
    # --- algorithm (verl 0.9.1 definitions; configs/<algorithm>.yaml name the combinations)
    adv_estimator: str = "grpo"
    """grpo | drgrpo (no std division) | rloo | reinforce++ | reinforce++-baseline | remax | gdpo"""
    adv_eps: float = 1e-6
    """epsilon in (r - mean) / (std + eps)"""
    loss_type: str = "ppo"
    """ppo (PPO-clip, dual-clip) | gspo (sequence-level ratio) | cispo (clipped detached IS weight x logp)"""
    clip_low: float = 0.2
    """clip: ratio >= 1 - clip_low"""
    clip_high: float = 0.2
    """clip: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)"""
    clip_ratio_c: float = 3.0
    """dual-clip (ppo): a token with A < 0 loses at most clip_ratio_c * |A| (0 = off)"""
    loss_agg: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)"""
    kl_coef: float = 0.0
    """KL-to-reference coefficient (0 = no reference model is loaded)"""
    kl_type: str = "k3"
    """KL estimator: k1 | abs | k2 | k3 (low_var_kl, clamped)"""
    kl_in_reward: bool = False
    """subtract kl_coef * sum_t KL(old || ref) from the reward instead of adding a KL loss term"""
    entropy_coef: float = 0.0
    """entropy bonus: loss -= entropy_coef * aggregated entropy (entropy is logged either way)"""
    tis: str = ""
    """truncated importance sampling pi_old / pi_rollout: '' (off) | token | sequence"""
    tis_cap: float = 2.0
    """upper bound of that importance weight"""
    tis_mode: str = "truncate"
    """truncate (w = min(w, cap)) | mask (w = 0 where w > cap)"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, generate more prompts until the batch is full"""
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
    """wandb project ('' = off); offline mode when WANDB_API_KEY is unset"""
    # --- long runs (checkpoint section)
    save_every: int = 0
    """sharded checkpoint out_dir/ckpt/step_N every N steps (0 = only on SIGTERM/SIGINT); export: scripts/export_hf.py"""
    keep_last: int = 2
    """checkpoints kept, older ones are deleted (0 = keep all)"""
    resume: str = ""
    """'' = start fresh | auto = the latest complete checkpoint in out_dir/ckpt (fresh if none) | a checkpoint folder"""
    dist_timeout: float = 1800.0
    """seconds a collective may wait: a dead or stuck rank fails the run instead of hanging it"""


def load_config(argv=None) -> Config:
    """`--config file.yaml` sets the defaults (unknown keys fail), the other flags override them."""
    import tyro
    import yaml
    argv = list(sys.argv[1:] if argv is None else argv)
    base = Config()
    if "--config" in argv:
        i = argv.index("--config")
        with open(argv[i + 1]) as f:
            base = replace(base, **(yaml.safe_load(f) or {}))  # TypeError on a typo'd key
        del argv[i:i + 2]
    return tyro.cli(Config, default=base, args=argv)


def init_dist(timeout_s: float = 1800.0):
    """torchrun or plain python: (rank, world, device). gloo on CPU, nccl on GPU."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    if not dist.is_initialized():  # main() may run again in the same process (tests)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")


def print0(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


# ---------------------------------------------------------------------------------------------------
# The algorithm: small pure tensor functions. B = sequences, R = response tokens.

def whiten(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten of per-sequence values broadcast over their tokens: (x - mean) / sqrt(var + 1e-8)
    with token-weighted mean and unbiased variance. x, lengths: (B,) -> (B,)."""
    w = lengths.float()
    n = w.sum()
    mean = (w * x).sum() / n
    var = (w * (x - mean) ** 2).sum() / n * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def advantages(reward, group_size: int, estimator: str = "grpo", lengths=None, baseline=None, components=None,
               eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantage (B,) from rewards (B,) in groups of group_size consecutive rows.
    lengths (B,): response tokens (whitening); baseline (B,): greedy reward (remax); components: list of (B,)
    reward components (gdpo). A group of 1 has mean 0 and std 1, as in verl."""
    r = reward.view(-1, group_size)                                    # (G, n)
    single = group_size == 1
    mean = torch.zeros_like(r) if single else r.mean(-1, keepdim=True)  # (G, 1)
    if estimator == "grpo":
        std = torch.ones_like(r) if single else r.std(-1, keepdim=True)
        return ((r - mean) / (std + eps)).view(-1)
    if estimator == "drgrpo":
        return (r - mean).view(-1)
    if estimator == "rloo":  # r_i - mean of the others = n / (n - 1) * (r_i - mean); a group of 1: r_i
        return reward.clone() if single else ((r - mean) * group_size / (group_size - 1)).view(-1)
    if estimator == "reinforce++":
        return whiten(reward, lengths)
    if estimator == "reinforce++-baseline":
        return whiten((r - mean).view(-1), lengths)
    if estimator == "remax":
        return reward - baseline
    if estimator == "gdpo":  # GRPO per reward component, summed (equal weights), then batch-whitened
        return whiten(sum(advantages(c, group_size, "grpo", eps=eps) for c in components), lengths)
    raise ValueError(f"adv_estimator: unknown {estimator!r}")


def policy_loss(logp, old_logp, adv, mask, loss_type: str = "ppo", clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0):
    """Per-token policy loss (B, R) and a clipped indicator (B, R). logp, old_logp, mask: (B, R); adv: (B,).

    ppo:   max(-A r, -A clip(r)), and for A < 0 at most -A c (dual-clip); r = exp(logp - old_logp).
    gspo:  the same clip on s_i = exp(mean_t(logp - old_logp)); sg[log s_i] + logp - sg[logp] keeps the
           value s_i per token while the gradient is s_i * grad(logp) (sequence level). No dual-clip.
    cispo: -sg[clip(r)] A logp: every token keeps a gradient, the IS weight carries none."""
    a = adv.unsqueeze(-1)                                              # (B, 1)
    log_ratio = logp - old_logp                                        # (B, R)
    if loss_type == "gspo":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)   # (B, 1)
        log_ratio = (seq.detach() + logp - logp.detach()).clamp(max=10.0)
    ratio = torch.exp(log_ratio if loss_type == "gspo" else log_ratio.clamp(-20, 20))
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    if loss_type == "cispo":
        return -clipped_ratio.detach() * a * logp, (ratio != clipped_ratio).float()
    if loss_type not in ("ppo", "gspo"):
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    loss1, loss2 = -a * ratio, -a * clipped_ratio
    loss = torch.maximum(loss1, loss2)
    if loss_type == "ppo" and clip_ratio_c:
        loss = torch.where(a < 0, torch.minimum(loss, -a * clip_ratio_c), loss)
    return loss, (loss2 > loss1).float()


def agg_loss(x, mask, mode: str, n_tok: float, n_seq: float, max_len: int) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: x, mask (b, R) -> scalar. n_tok / n_seq are the
    valid tokens / sequences of the whole mini-batch over all ranks, so the shares sum to the exact loss."""
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
    """Truncated importance weight pi_old / pi_rollout (B, R), no gradient. Rows without rollout log-probs
    (NaN: offline trajectories) get 1. sequence: one weight per row from the summed log-ratio."""
    log_ratio = torch.where(rollout_logp.isnan(), 0.0, old_logp - rollout_logp) * mask     # (B, R)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    w = torch.exp(log_ratio.clamp(-20, 20)).detach() * mask
    return w.clamp(max=cap) if mode == "truncate" else w * (w <= cap)


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO soft overlong punishment: 0 up to max_len - buffer tokens, then linear down to -1 at max_len."""
    return max(-1.0, min(0.0, (max_len - buffer - length) / buffer))


def token_logp(model, batch: dict, temperature: float, banned: list[int]):
    """Log-prob and entropy of each response token at the sampling temperature: (B, R), (B, R).

    Prompts are left-padded and responses right-padded, so every response starts at the same column
    and the model only projects the last R+1 hidden states onto the vocabulary (logits_to_keep)."""
    R = batch["mask"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                mm_token_type_ids=batch["mm_token_type_ids"], logits_to_keep=R + 1, **batch["mm"])
    logits = out.logits[:batch.get("rows"), :-1].float() / temperature  # (B, R, V), dummy rows dropped
    logits[..., banned] = -1e9  # the sampler masks vision tokens; finite so entropy has no 0 * inf
    lse = torch.logsumexp(logits, -1)                                  # (B, R)
    logp = logits.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)       # stable form, as verl
    return logp, entropy


def collate(rollouts: list[Rollout], pad_id: int, tokenizer, device, dummies: dict | None = None) -> dict:
    """Left-pad prompts, right-pad responses; concatenate the media of every row in order.
    dummies (data.dummy_prompts): a response-less row is appended for each modality no row has, so the
    vision tower runs for images and for videos in every forward on every rank (FSDP2's all-gathers and
    reduce-scatters stay aligned); token_logp drops those rows, their gradient is exactly zero."""
    rows = len(rollouts)
    have = {k for r in rollouts for k in r.prompt.mm}
    rollouts = rollouts + [Rollout(p, [], None, "", "dummy") for p in data.missing_dummies(dummies, have)]
    P = max(len(r.prompt.prompt_ids) for r in rollouts)
    R = max(max(len(r.response_ids) for r in rollouts), 1)
    B = len(rollouts)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R))
    rollout_logp = torch.full((B, R), float("nan"))  # NaN: no sampler log-probs (offline trajectory)
    for i, r in enumerate(rollouts):
        p, y = r.prompt.prompt_ids, r.response_ids
        input_ids[i, P - len(p):P], input_ids[i, P:P + len(y)] = torch.tensor(p), torch.tensor(y, dtype=torch.long)
        attn[i, P - len(p):P + len(y)] = 1
        mask[i, :len(y)] = 1
        if r.logp:
            rollout_logp[i, :len(y)] = torch.tensor(r.logp)
    mm = {k: v.to(device) for k, v in data.concat_media([r.prompt for r in rollouts]).items()}
    input_ids = input_ids.to(device)
    return dict(input_ids=input_ids, attention_mask=attn.to(device), mask=mask[:rows].to(device), mm=mm,
                rollout_logp=rollout_logp[:rows].to(device), rows=rows,
                response_ids=input_ids[:rows, P:], mm_token_type_ids=mm_token_types(input_ids, tokenizer))


def offline_rollout(prompt: data.Prompt, tokenizer, eos_id: int, max_len: int) -> Rollout:
    """The sample's curated trajectory as a rollout: its tokens + EOS (so the policy learns to stop),
    truncated to the response budget like any sampled completion."""
    text = prompt.sample["offline_output"]
    ids = (tokenizer.encode(text, add_special_tokens=False) + [eos_id])[:max_len]
    return Rollout(prompt, ids, None, text, "offline")


def swap_offline(group: list[Rollout], scores: list, cfg: Config, tok, eos_id: int) -> tuple[list, list]:
    """Mixed offline-online: the sample's offline_output replaces the LAST rollout of its group (always, or with
    mix_threshold > 0 only when the group's online accuracy is below it). Returns (group, scores), new lists."""
    p = group[0].prompt
    online_acc = sum(c["accuracy"] for _, c in scores) / len(scores)
    if not cfg.mix_offline or not p.sample.get("offline_output") or (cfg.mix_threshold and online_acc >= cfg.mix_threshold):
        return group, scores
    off = offline_rollout(p, tok, eos_id, cfg.max_response_len)
    return group[:-1] + [off], scores[:-1] + [score(off, cfg)]


def score(r: Rollout, cfg: Config) -> tuple[float, dict]:
    """rewards.compute_reward plus DAPO's soft overlong penalty (its own component, so GDPO sees it)."""
    overall, comp = rewards.compute_reward(r.text, r.prompt.sample, cfg.w_acc, cfg.w_fmt, cfg.format_template)
    if cfg.overlong_buffer:
        comp["overlong"] = cfg.overlong_factor * overlong_penalty(len(r.response_ids), cfg.max_response_len,
                                                                  cfg.overlong_buffer)
        overall = comp["overall"] = overall + comp["overlong"]
    return overall, comp


def sample_round(engine, samples: list, prep, cfg: Config, rank: int, world: int, tok, eos_id: int, seed: int) -> list:
    """One generation round for this rank's share of `samples`: [(rollouts, scores, greedy_reward)] per group.
    ReMax asks the engine for one extra greedy response per prompt; its reward is the baseline."""
    share, start, k = tp_share(samples, rank, world, cfg.rollout_tp)
    prompts, n = [prep(s) for s in share], cfg.group_size
    rollouts = engine.generate(prompts, n, cfg.temperature, cfg.max_response_len, seed)[start * n:(start + k) * n]
    greedy = engine.generate(prompts, 1, 0.0, cfg.max_response_len, seed)[start:start + k] \
        if cfg.adv_estimator == "remax" else [None] * k
    groups = []
    for i in range(k):
        g = rollouts[i * n:(i + 1) * n]
        g, sc = swap_offline(g, [score(r, cfg) for r in g], cfg, tok, eos_id)
        groups.append((g, sc, score(greedy[i], cfg)[0] if greedy[i] else 0.0))
    return groups


def sample_batch(engine, next_samples, prep, cfg: Config, rank: int, world: int, tok, eos_id: int, seed: int):
    """This rank's prompts_per_step / world groups. With DAPO dynamic sampling, groups whose rewards are all
    equal are dropped and more rounds are generated until every rank is full or max_gen_rounds is reached;
    then dropped groups fill the batch (counted). Returns groups and {rounds, dropped, refilled}."""
    need, kept, dropped, rounds = cfg.prompts_per_step // world, [], [], 0
    while True:
        rounds += 1
        for grp in sample_round(engine, next_samples(), prep, cfg, rank, world, tok, eos_id, seed):
            rs = [s[0] for s in grp[1]]
            (kept if not cfg.dynamic_sampling or len(rs) == 1 or max(rs) > min(rs) else dropped).append(grp)
        short = all_reduce([float(len(kept) < need)])[0]  # all ranks take the same number of rounds
        if not short or rounds >= cfg.max_gen_rounds:
            break
    refilled = max(0, need - len(kept))
    return (kept + dropped[:refilled])[:need], {"rounds": rounds, "dropped": len(dropped), "refilled": refilled}


def split_batch(n: int, mini_batches: int, micro_batch_size: int) -> list[list[list[int]]]:
    """Row indices of each micro-batch of each mini-batch: contiguous, mini-batch sizes differ by at most 1."""
    bounds = [n * j // mini_batches for j in range(mini_batches + 1)]
    return [[list(range(i, min(i + micro_batch_size, hi))) for i in range(lo, hi, micro_batch_size)]
            for lo, hi in zip(bounds, bounds[1:])]


def global_counts(batches: list[dict]) -> tuple[float, float]:
    """Valid tokens and valid sequences of a mini-batch over all ranks: the loss normalizers."""
    n_tok, n_seq = all_reduce([sum(b["mask"].sum().item() for b in batches),
                               sum((b["mask"].sum(-1) > 0).sum().item() for b in batches)])
    return n_tok, n_seq


def micro_loss(model, b: dict, adv, old_logp, ref_logp, cfg: Config, banned: list[int], n_tok: float, n_seq: float):
    """This micro-batch's share of its mini-batch loss (backward it, summed over micro-batches and ranks it is
    the mini-batch loss) and its metric sums. old_logp None: on-policy, old = sg[logp] (ratio 1)."""
    logp, ent = token_logp(model, b, cfg.temperature, banned)           # (b, R)
    mask, old = b["mask"], logp.detach() if old_logp is None else old_logp
    agg = lambda x: agg_loss(x, mask, cfg.loss_agg, n_tok, n_seq, cfg.max_response_len)  # noqa: E731
    pg, clipped = policy_loss(logp, old, adv, mask, cfg.loss_type, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)
    has = ~b["rollout_logp"].isnan() & (mask > 0)  # health: sampler vs trainer log-probs on the same tokens
    d = torch.where(has, (old - b["rollout_logp"]).abs(), 0.0)
    m = {"clipfrac": (clipped * mask).sum().item(), "entropy": (ent.detach() * mask).sum().item(),
         "mismatch_sum": d.sum().item(), "mismatch_n": has.sum().item(), "mismatch_max": d.max().item()}
    if cfg.tis:
        w = is_weight(old, b["rollout_logp"], mask, cfg.tis, cfg.tis_cap, cfg.tis_mode)
        raw = is_weight(old, b["rollout_logp"], mask, cfg.tis, float("inf"))
        m.update(tis_weight=w.sum().item(), tis_clipped=((w != raw) & has).sum().item())
        pg = pg * w
    loss = agg(pg)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * agg(ent)
    if ref_logp is not None and not cfg.kl_in_reward:
        kl = kl_penalty(logp, ref_logp, cfg.kl_type)
        loss = loss + cfg.kl_coef * agg(kl)
        m["kl"] = (kl.detach() * mask).sum().item()
    m["loss"] = loss.item()
    return loss, m


def batch_advantages(reward, scored: list, baseline: list, lengths: list, cfg: Config):
    """Advantages of this rank's rows, computed on the global batch (whitening needs every rank's rewards;
    groups never span ranks). Component keys for GDPO: accuracy, format (+ overlong)."""
    keys = ["accuracy", "format"] + (["overlong"] if cfg.overlong_buffer else [])
    x = torch.stack([reward, torch.tensor(baseline), torch.tensor(lengths, dtype=torch.float32)]
                    + [torch.tensor([s[1][k] for s in scored], dtype=torch.float32) for k in keys])   # (C, B)
    parts = gather(x)
    rank = dist.get_rank() if dist.is_initialized() else 0
    full, start = torch.cat(parts, 1), sum(p.shape[1] for p in parts[:rank])                            # (C, B_all)
    adv = advantages(full[0], cfg.group_size, cfg.adv_estimator, lengths=full[2], baseline=full[1],
                     components=list(full[3:]), eps=cfg.adv_eps)
    return adv[start:start + x.shape[1]]


def epochs(n: int, seed: int, pos: dict):
    """Sample indices forever, a fresh permutation per epoch (the same on every rank). pos {"epoch", "cursor"}
    says where to start (a checkpoint's data position) and is kept at the next index, so it can be saved."""
    g = torch.Generator().manual_seed(seed)
    for epoch in itertools.count():
        perm = torch.randperm(n, generator=g).tolist()  # drawn for passed epochs too: g must advance
        if epoch < pos["epoch"]:
            continue
        pos["epoch"] = epoch
        while pos["cursor"] < n:
            pos["cursor"] += 1
            yield perm[pos["cursor"] - 1]
        pos["cursor"] = 0


def lr_at(step: int, cfg: Config) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------------------------------------------
# Setup helpers

def load_model(cfg: Config, device):
    """HF model, FSDP2-sharded per decoder layer and vision block (one marked block), fp32 master
    weights; bf16 compute on GPU."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForImageTextToText
    cuda = device.type == "cuda"
    attn = "sdpa"
    if cuda:
        try:
            import flash_attn  # noqa: F401
            attn = "flash_attention_2"
        except ImportError:
            pass
    model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation=attn,
                                                        trust_remote_code=cfg.trust_remote_code).to(device)
    if dist.is_initialized():
        # ---- FSDP2 block: each layer/block is its own all-gather unit, the root holds the rest
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
        inner = model.model
        for block in list(inner.language_model.layers) + list(inner.visual.blocks):
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    return model


def tp_share(items: list, rank: int, world: int, tp: int):
    """The list a TP group generates (identical on its ranks) and where this rank's part lies in it.
    Rank r trains on items[r::world]; its TP group is ranks [r - r % tp, r - r % tp + tp)."""
    g0 = rank - rank % tp
    parts = [items[q::world] for q in range(g0, g0 + tp)]
    start = sum(len(x) for x in parts[:rank - g0])
    return [x for part in parts for x in part], start, len(parts[rank - g0])


def all_reduce(x: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """A few numbers reduced over all ranks, in float64, on the device the backend needs (nccl: GPU, gloo: CPU)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor(x, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return t.tolist()


def gather(obj):
    """All ranks' objects, in rank order (small metric dicts only)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def evaluate_accuracy(engine, prompts: list, cfg: Config, rank: int, world: int, step: int = 0) -> float:
    """Greedy held-out accuracy over all ranks, scored and aggregated by evaluate.py (the code of the standalone
    evaluator, on the colocated engine); per-sample rows (lmms-eval fields) in out_dir/eval/step_N.jsonl."""
    share, start, k = tp_share(prompts, rank, world, cfg.rollout_tp)
    # every rank generates as many prompts as rank 0 (the largest share): the HF engine's generate is collective
    share = share + prompts[:1] * (len(tp_share(prompts, 0, world, cfg.rollout_tp)[0]) - len(share))
    outs = engine.generate(share, n=1, temperature=0.0, max_tokens=cfg.max_response_len, seed=cfg.seed)[start:start + k]
    rows = [x for part in gather([evaluate.record(r.prompt.sample, "nvr1", r.prompt.text, r.text) for r in outs])
            for x in part]
    if rank == 0:
        os.makedirs(os.path.join(cfg.out_dir, "eval"), exist_ok=True)
        evaluate.write_jsonl(os.path.join(cfg.out_dir, "eval", f"step_{step}.jsonl"), rows)
    return evaluate.aggregate(rows, "nvr1")["accuracy"] / 100 if rows else float("nan")


def save_checkpoint(model, processor, path: str, rank: int):
    """Full HF-format folder (safetensors + config + processor) that vLLM and transformers load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if dist.is_initialized() else model.state_dict()
    if rank == 0:
        model.save_pretrained(path, state_dict=sd)
        processor.save_pretrained(path)
        model.generation_config.save_pretrained(path)


def plot_curve(rows: list[dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["reward/mean"] for r in rows], label="train reward")
    ax.plot([r["step"] for r in rows], [r["reward/accuracy"] for r in rows], label="train accuracy")
    ev = [r for r in rows if "eval/accuracy" in r]
    ax.plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("step"), ax.set_ylim(-0.02, 1.02), ax.legend(), ax.grid(alpha=0.3)
    fig.tight_layout(), fig.savefig(path, dpi=100), plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# Bad samples met during training: reported and replaced, every rank in lockstep

def try_prep(prep, s: dict, cfg: Config):
    """(Prompt, None), or with skip_invalid (None, a skip report); without it the error names the sample."""
    try:
        return prep(s), None
    except ValueError as e:  # data.DataError, cache.VideoError, the resizer's ValueError on absurd sizes
        if not cfg.skip_invalid:
            raise data.DataError(f"sample {s['id']}: {e}") from e
        return None, {"where": s["id"], "media": s.get("videos", []) + s.get("images", []), "error": str(e)}


def prep_all(prep, samples: list, cfg: Config, skipped: list) -> list:
    out = [try_prep(prep, s, cfg) for s in samples]
    skipped += [r for _, r in out if r]
    return [p for p, _ in out if p]


def next_valid(stream, samples: list, prep, cfg: Config, rank: int, world: int, skipped: list, memo: dict) -> list:
    """The next prompts_per_step samples, each prepared (into memo, by object id) on the ranks that generate it.
    A sample that fails (skip_invalid) is reported and its slot refilled from the stream; the failures are
    gathered, so every rank refills the same slots, reports the same skips and keeps the same stream position."""
    memo.clear()
    batch, todo, tp = [samples[next(stream)] for _ in range(cfg.prompts_per_step)], range(cfg.prompts_per_step), cfg.rollout_tp
    while todo:
        done = {i: try_prep(prep, batch[i], cfg) for i in todo if i % world // tp == rank // tp}  # tp_share's rows
        memo.update({id(batch[i]): p for i, (p, _) in done.items() if p})
        bad = {i: r for part in gather({i: r for i, (_, r) in done.items() if r}) for i, r in part.items()}
        todo = sorted(bad)
        for i in todo:
            skipped.append(bad[i])
            batch[i] = samples[next(stream)]
    return batch


# ---------------------------------------------------------------------------------------------------
# Checkpoints: sharded (torch.distributed.checkpoint), atomic, the last keep_last kept; exact resume; preemption.
#   out_dir/ckpt/step_N/   DCP shards (model, optimizer), rng_<rank>.safetensors, meta.json (step, data position,
#                          config, wandb id, skips), config + processor (scripts/export_hf.py needs nothing else)
#   out_dir/ckpt/latest    the name of the newest complete step_N (written last, atomically)

def catch_stop_signals() -> list:
    """SIGTERM/SIGINT (preemption, Ctrl-C) only record the signal: the loop checkpoints at the next step boundary."""
    got = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, frame: got.append(num))
    return got


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any: a signal may reach only some ranks."""
    return bool(all_reduce([float(flag)], dist.ReduceOp.MAX)[0])


def barrier():
    if dist.is_initialized():
        dist.barrier()


def model_optim_state(model, opt) -> dict:
    """DCP's view of model + optimizer: DTensor shards under FSDP2, so each rank writes and reads its own part."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save_ckpt(cfg: Config, step: int, model, opt, processor, meta: dict, rank: int):
    """Every rank writes its shards and RNG state into step_N.tmp; after a barrier rank 0 adds meta.json, renames
    the folder to step_N, then points `latest` at it: a crash at any moment leaves `latest` complete."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    root = os.path.join(cfg.out_dir, "ckpt")
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier attempt at this step
    barrier()
    dcp.save(model_optim_state(model, opt), checkpoint_id=tmp)
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    save_file(rng, os.path.join(tmp, f"rng_{rank}.safetensors"))
    barrier()  # every rank's files are written
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        processor.save_pretrained(tmp), model.config.save_pretrained(tmp), model.generation_config.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a resumed run that reached this step again
        os.rename(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
        for old in steps[:-cfg.keep_last] if cfg.keep_last else []:
            shutil.rmtree(os.path.join(root, old))
    barrier()


def find_ckpt(cfg: Config) -> str:
    """The folder to resume from: '' (none), cfg.resume itself, or for 'auto' the one `latest` names ('' if none)."""
    latest = os.path.join(cfg.out_dir, "ckpt", "latest")
    if cfg.resume != "auto":
        return cfg.resume
    return os.path.join(cfg.out_dir, "ckpt", open(latest).read().strip()) if os.path.exists(latest) else ""


def load_ckpt(path: str, model, opt) -> dict:
    """Model, optimizer and this rank's RNG restored in place (DCP reshards: the world size may change; a new rank
    keeps its fresh RNG). Returns meta.json (step, data position, wandb id, ...)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_state_dict
    if not os.path.exists(os.path.join(path, "meta.json")):
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no meta.json)")
    state = model_optim_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = os.path.join(path, f"rng_{dist.get_rank() if dist.is_initialized() else 0}.safetensors")
    if os.path.exists(rng):
        rng = load_file(rng)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def write_skipped(cfg: Config, skipped: list):
    evaluate.write_jsonl(os.path.join(cfg.out_dir, "skipped.jsonl"), skipped)  # atomic: never a torn report


# ---------------------------------------------------------------------------------------------------
def main(cfg: Config):
    rank, world, device = init_dist(cfg.dist_timeout)
    torch.manual_seed(cfg.seed)
    assert cfg.prompts_per_step % world == 0, "prompts_per_step must be divisible by the world size"
    assert world % cfg.rollout_tp == 0, "world size must be divisible by rollout_tp"
    if cfg.kl_in_reward and cfg.adv_estimator == "gdpo":
        raise ValueError("kl_in_reward: gdpo normalizes the reward components, which carry no KL; use kl_coef as a loss")
    os.makedirs(cfg.out_dir, exist_ok=True)
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    tok = processor.tokenizer
    template = open(cfg.prompt_template).read() if cfg.prompt_template else None
    skipped: list = []
    train_samples = data.load_samples(cfg.train_data, cfg.skip_invalid, skipped)
    val_samples = data.load_samples(cfg.val_data, cfg.skip_invalid, skipped)[:cfg.eval_max_samples] if cfg.val_data else []
    model = load_model(cfg, device)
    ref = load_model(cfg, device).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    ckpt = find_ckpt(cfg)
    state = load_ckpt(ckpt, model, opt) if ckpt else {}  # before the engine is built: it gets these weights
    eos_ids = model.generation_config.eos_token_id
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    banned = vision_token_ids(tok)
    dummies = data.dummy_prompts(processor) if world > 1 else None  # FSDP: same modules in every forward
    if cfg.rollout == "vllm":
        # the trainer's compute dtype: vLLM's "auto" would downcast an fp32 checkpoint to bf16 on CPU
        engine = VLLMEngine(cfg.model, tok, tp=cfg.rollout_tp, max_model_len=cfg.max_model_len,
                            dtype="bfloat16" if device.type == "cuda" else "float32",
                            gpu_memory_utilization=cfg.gpu_memory_utilization, sleep=cfg.vllm_sleep,
                            seed=cfg.seed, trust_remote_code=cfg.trust_remote_code,
                            max_images=max([len(s.get("images", [])) for s in train_samples + val_samples] + [1]),
                            max_videos=max([len(s.get("videos", [])) for s in train_samples + val_samples] + [1]))
        engine.sync(model)  # from the first step on, the engine and the trainer hold the same weights
    else:
        engine = HFEngine(model, tok, eos_ids, dummies)
    signals = catch_stop_signals()  # after the engine: ours must be the handlers that run
    stats = {"cache_hit": 0, "cache_miss": 0, "cache_corrupt": 0, "decode": 0, "decode_s": 0.0}
    memo = {}  # this step's prompts, prepared by next_valid
    prep = lambda s: memo.get(id(s)) or data.prepare(s, processor, cfg, stats, template)  # noqa: E731
    vcfg = replace(cfg, **{k[4:]: v for k, v in asdict(cfg).items() if k.startswith(("val_video_", "val_image_")) and v})
    val_prompts = prep_all(lambda s: data.prepare(s, processor, vcfg, stats, template), val_samples, vcfg, skipped)
    skipped = state.get("skipped", skipped)  # a resumed run: the saved report already holds the load/val skips
    rows, wb = [], None
    if rank == 0 and cfg.wandb_project:
        import wandb
        wb = wandb.init(project=cfg.wandb_project, config=asdict(cfg), dir=cfg.out_dir, id=state.get("wandb_id"), resume="allow",
                        mode="online" if os.environ.get("WANDB_API_KEY") else "offline")
    acc_before = state["acc_before"] if state else evaluate_accuracy(engine, val_prompts, cfg, rank, world) if val_prompts else float("nan")
    print0(f"resumed from {ckpt} (step {state['step']})") if state else None
    print0(f"step 0 | held-out accuracy {acc_before:.3f} | {len(train_samples)} train, {len(val_prompts)} val, "
           f"{len(skipped)} skipped | world {world} | rollout {cfg.rollout} tp={cfg.rollout_tp}")
    pos = state.get("data", {"epoch": 0, "cursor": 0})  # data position, saved in every checkpoint
    stream = epochs(len(train_samples), cfg.seed, pos)  # the same order on every rank
    next_samples = lambda: next_valid(stream, train_samples, prep, cfg, rank, world, skipped, memo)  # noqa: E731
    need_old = cfg.ppo_epochs > 1 or cfg.mini_batches > 1 or cfg.kl_in_reward
    write_skipped(cfg, skipped) if rank == 0 else None  # load-time skips; training-time ones as they happen
    acc_after = float("nan")  # held-out accuracy after the last step (evaluated inside the loop, so it is logged)
    for step in range(state.get("step", 0) + 1, cfg.max_steps + 1):
        t0 = time.time()
        before, n_skipped = dict(stats), len(skipped)
        # ------------------------------------------------------------------ sample (+ DAPO dynamic sampling)
        seed = request_seed(cfg.seed, step, 0)
        groups, dyn = sample_batch(engine, next_samples, prep, cfg, rank, world, tok, eos_ids[0], seed)
        engine.sleep()
        t_gen = time.time() - t0
        # ------------------------------------------------------------------ reward
        rollouts = [r for g in groups for r in g[0]]
        scored = [s for g in groups for s in g[1]]
        baseline = [g[2] for g in groups for _ in g[0]]
        reward = torch.tensor([s[0] for s in scored], dtype=torch.float32)
        # ------------------------------------------------------------------ old / ref log-probs (no grad, once)
        t1 = time.time()
        plan = split_batch(len(rollouts), cfg.mini_batches, cfg.micro_batch_size)
        batches = [[collate([rollouts[j] for j in mb], tok.pad_token_id, tok, device, dummies) for mb in mini] for mini in plan]
        logps = lambda m, on: [[token_logp(m, b, cfg.temperature, banned)[0] if on else None for b in mini]  # noqa: E731
                               for mini in batches]
        with torch.no_grad():
            old_logps, ref_logps = logps(model, need_old), logps(ref, ref is not None)
        kl_reward = torch.zeros_like(reward)
        if cfg.kl_in_reward and ref is not None:  # verl apply_kl_penalty: on old (rollout-time) log-probs
            kl_reward = torch.cat([(kl_penalty(o, r, cfg.kl_type) * b["mask"]).sum(-1).cpu() for mo, mr, mb in
                                   zip(old_logps, ref_logps, batches) for o, r, b in zip(mo, mr, mb)])
            reward = reward - cfg.kl_coef * kl_reward
        # ------------------------------------------------------------------ advantage
        lengths = [len(r.response_ids) for r in rollouts]
        adv = batch_advantages(reward, scored, baseline, lengths, cfg).to(device)
        # ------------------------------------------------------------------ loss and step
        for group_param in opt.param_groups:
            group_param["lr"] = lr_at(step - 1, cfg)
        m, gnorms = {"kl": kl_reward.sum().item()}, []  # grad_norm logged: the mean over this step's optimizer steps
        for epoch in range(cfg.ppo_epochs):
            for mini, bs, olds, refs in zip(plan, batches, old_logps, ref_logps):
                n_tok_mb, n_seq_mb = global_counts(bs)
                for mb, b, old, ref_lp in zip(mini, bs, olds, refs):
                    loss, mm = micro_loss(model, b, adv[mb], old, ref_lp, cfg, banned, n_tok_mb, n_seq_mb)
                    (loss * world).backward()  # FSDP averages gradients over ranks: x world makes it their sum
                    for k2, v in mm.items() if epoch == 0 else ():
                        m[k2] = max(m.get(k2, 0.0), v) if k2 == "mismatch_max" else m.get(k2, 0.0) + v
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                gnorms.append(float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm))
                opt.step()
                opt.zero_grad(set_to_none=True)
        m["loss"] /= len(plan)
        m.update({f"dyn_{k2}": v for k2, v in dyn.items()})
        n_tok = sum(gather(float(sum(lengths))))
        t_train = time.time() - t1
        # ------------------------------------------------------------------ sync
        t2 = time.time()
        engine.sync(model)
        t_sync = time.time() - t2
        # ------------------------------------------------------------------ log
        local = {
            "reward": [s[0] for s in scored], "baseline": baseline, "types": [rewards.canonical_type(r.prompt.sample["problem_type"]) for r in rollouts],
            "comp": [s[1] for s in scored], "len": lengths,
            "offline": [r.finish == "offline" for r in rollouts], "adv": adv.tolist(), "truncated": [r.finish == "length" for r in rollouts],
            "m": m, "stats": {k2: stats[k2] - before[k2] for k2 in stats},
        }
        parts = gather(local)
        ids = [i for part in gather([g[0][0].prompt.sample["id"] for g in groups]) for i in part]
        if rank == 0:
            row = step_metrics(parts, step, cfg, sum(gnorms) / len(gnorms), lr_at(step - 1, cfg), n_tok,
                               dict(gen=t_gen, train=t_train, sync=t_sync, step=time.time() - t0))
            row.update({"data/skipped": len(skipped), "data/skipped_step": len(skipped) - n_skipped, "data/ids": ids})
            write_skipped(cfg, skipped) if len(skipped) > n_skipped else None
        # ------------------------------------------------------------------ eval / save
        if val_prompts and (step == cfg.max_steps or cfg.eval_every and step % cfg.eval_every == 0):
            acc_after = evaluate_accuracy(engine, val_prompts, cfg, rank, world, step)  # the last one is the result
            if rank == 0:
                row["eval/accuracy"] = acc_after
        if rank == 0:
            rows.append(row)
            print0(" | ".join([f"step {step}"] + [f"{k2} {v:.4g}" for k2, v in row.items() if k2 in LOG_KEYS]))
            with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            if wb:
                wb.log(row, step=step)
        # ------------------------------------------------------------------ checkpoint / preemption
        stop = any_rank(bool(signals))
        if stop or (cfg.save_every and step % cfg.save_every == 0):
            meta = dict(step=step, data=pos, config=asdict(cfg), wandb_id=wb and wb.id, acc_before=acc_before, skipped=skipped)
            save_ckpt(cfg, step, model, opt, processor, meta, rank)
        if stop:
            print0(f"step {step}: stop signal {signals}: checkpoint saved, exiting")
            return acc_before, float("nan")
    if rank == 0 and rows:
        rows.insert(0, {"step": 0, "reward/mean": float("nan"), "reward/accuracy": float("nan"), "eval/accuracy": acc_before})
        plot_curve(rows, os.path.join(cfg.out_dir, "curve.png"))
        with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
            json.dump({"acc_before": acc_before, "acc_after": acc_after, "config": asdict(cfg)}, f, indent=1)
    if cfg.save:
        save_checkpoint(model, processor, os.path.join(cfg.out_dir, "final"), rank)
    if wb:
        wb.finish()
    print0(f"held-out accuracy: before {acc_before:.2f} after {acc_after:.2f}")
    if dist.is_initialized():
        dist.barrier()
    return acc_before, acc_after


LOG_KEYS = ("reward/mean", "reward/accuracy", "reward/format", "reward/parse_fail", "len/mean", "loss", "clipfrac",
            "entropy", "grad_norm", "mismatch/mean", "eval/accuracy", "time/step", "time/gen", "time/train", "tokens/s")


def step_metrics(parts: list[dict], step: int, cfg: Config, gnorm: float, lr: float, n_tok: float, times: dict) -> dict:
    """Global metrics from every rank's raw values (exact means, not means of means)."""
    cat = lambda k: [x for p in parts for x in p[k]]  # noqa: E731
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    msum = lambda k: sum(p["m"][k] for p in parts)  # noqa: E731
    rew, comp, types, off, adv = cat("reward"), cat("comp"), cat("types"), cat("offline"), cat("adv")
    row = {"step": step, "reward/mean": mean(rew), "lr": lr, "grad_norm": gnorm, "loss": msum("loss"),
           "clipfrac": msum("clipfrac") / n_tok, "entropy": msum("entropy") / n_tok, "kl": msum("kl") / n_tok,
           "mismatch/mean": msum("mismatch_sum") / max(1.0, msum("mismatch_n")),
           "mismatch/max": max(p["m"]["mismatch_max"] for p in parts),
           "len/mean": mean(cat("len")), "len/truncated": mean(cat("truncated")), "tokens/s": n_tok / times["step"]}
    for key in [k for k in ("accuracy", "format", "parse_fail", "overlong") if k in comp[0]]:
        row[f"reward/{key}"] = mean([c[key] for c in comp])
        for t in sorted(set(types)):
            row[f"reward/{key}/{t}"] = mean([c[key] for c, ty in zip(comp, types) if ty == t])
    g = [rew[i:i + cfg.group_size] for i in range(0, len(rew), cfg.group_size)]
    row["zero_std_groups"] = mean([float(max(x) == min(x)) for x in g])
    row.update({"dyn/rounds": parts[0]["m"]["dyn_rounds"], "dyn/dropped": msum("dyn_dropped"),
                "dyn/refilled": msum("dyn_refilled")})
    if cfg.tis:
        row.update({"tis/weight": msum("tis_weight") / n_tok, "tis/clipped": msum("tis_clipped") / n_tok})
    if cfg.adv_estimator == "remax":
        row["reward/greedy"] = mean(cat("baseline"))
    if any(off):
        row["offline/share"] = mean(off)
        row["offline/reward"] = mean([r for r, o in zip(rew, off) if o])
        row["offline/adv"] = mean([a for a, o in zip(adv, off) if o])
        row["online/reward"] = mean([r for r, o in zip(rew, off) if not o])
    for k in parts[0]["stats"]:
        row[f"cache/{k}"] = sum(p["stats"][k] for p in parts)
    row.update({f"time/{k}": v for k, v in times.items()})
    return row


if __name__ == "__main__":
    main(load_config())

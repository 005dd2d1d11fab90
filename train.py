"""train.py: GRPO for video (and image) VLMs, in one file you read top to bottom.

    python train.py --config configs/tiny_cpu.yaml                              # one process
    torchrun --nproc_per_node=2 train.py --config configs/tiny_cpu.yaml         # this CPU (gloo)
    torchrun --nproc_per_node=8 train.py --config configs/qwen2_5_vl_7b.yaml    # one 8-GPU node (nccl)

Every rank runs the same loop (SPMD, no controller): FSDP2 shards the policy, a vLLM engine lives in
the same process (rollout.py) and gets the new weights after every optimizer step.

One step:
  sample     prompts_per_step prompts (global), group_size completions each
  offline    a sample's `offline_output` replaces the last rollout of its group (mixed offline-online)
  reward     rewards.compute_reward -> (overall, components), logged per problem type
  advantage  group-normalized: (r - mean_group) / (std_group + eps)
  loss       PPO-clip on trainer log-probs (recomputed at the sampling temperature), token-mean over
             the whole global batch (micro-batch and rank splits do not change it), optional k3 KL
  step       AdamW, grad clipping, warmup + cosine schedule
  sync       weights -> vLLM, caches reset
Deviations from the GRPO paper, on purpose: a single update per batch by default, so old_logp is the
detached trainer logp (ratio = 1, the loss is the plain policy gradient) and clipping only matters with
ppo_epochs > 1; the offline trajectory is treated as on-policy (ratio 1 against the current policy: the
behaviour policy's probabilities are unknown).
"""
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

import data
import rewards
from rollout import HFEngine, Rollout, VLLMEngine, mm_token_types, vision_token_ids


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
    """pixel budget over all frames of a video (0 = no budget)"""
    image_min_pixels: int = 3136
    """min pixels per image"""
    image_max_pixels: int = 1003520
    """max pixels per image"""
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
    # --- reward
    w_acc: float = 0.9
    """weight of the accuracy reward"""
    w_fmt: float = 0.1
    """weight of the format reward"""
    format_template: str = "answer"
    """format reward template: answer (<answer>..</answer>) | think_answer"""
    # --- algorithm
    adv_eps: float = 1e-6
    """epsilon in (r - mean) / (std + eps)"""
    clip_low: float = 0.2
    """PPO clip: ratio >= 1 - clip_low"""
    clip_high: float = 0.2
    """PPO clip: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)"""
    kl_coef: float = 0.0
    """k3 KL-to-reference loss coefficient (0 = no reference model is loaded)"""
    ppo_epochs: int = 1
    """passes over each rollout batch (>1 makes the ratio and clipping matter)"""
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


def init_dist():
    """torchrun or plain python: (rank, world, device). gloo on CPU, nccl on GPU."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return rank, world, torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")


def print0(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


# ---------------------------------------------------------------------------------------------------
# The algorithm: small pure tensor functions. B = sequences, R = response tokens.

def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean_group) / (std_group + eps), unbiased std; a group of 1 gets 0."""
    r = rewards.view(-1, group_size)                                   # (G, n)
    std = r.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(r)
    return ((r - r.mean(-1, keepdim=True)) / (std + eps)).view(-1)     # (B,)


def policy_loss(logp, old_logp, adv, clip_low=0.2, clip_high=0.2):
    """PPO-clip per token. logp, old_logp: (B, R); adv: (B,). Returns loss (B, R), clipped (B, R)."""
    ratio = torch.exp(logp - old_logp)                                 # (B, R)
    a = adv.unsqueeze(-1)                                              # (B, 1)
    loss1, loss2 = -a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(loss1, loss2), (loss2 > loss1).float()


def kl_k3(logp, ref_logp):
    """k3 estimator of KL(pi || ref) per token, clamped as verl does: exp(ref - logp) - (ref - logp) - 1."""
    d = (ref_logp - logp).clamp(-20, 20)
    return (torch.exp(d) - d - 1).clamp(-10, 10)


def masked_sum(x, mask):
    return (x * mask).sum()


def token_logp(model, batch: dict, temperature: float, banned: list[int]):
    """Log-prob and entropy of each response token at the sampling temperature: (B, R), (B, R).

    Prompts are left-padded and responses right-padded, so every response starts at the same column
    and the model only projects the last R+1 hidden states onto the vocabulary (logits_to_keep)."""
    R = batch["mask"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                mm_token_type_ids=batch["mm_token_type_ids"], logits_to_keep=R + 1, **batch["mm"])
    logits = out.logits[:, :-1].float() / temperature                 # (B, R, V)
    logits[..., banned] = -1e9  # the sampler masks vision tokens; finite so entropy has no 0 * inf
    logp_all = torch.log_softmax(logits, -1)                           # (B, R, V)
    logp = logp_all.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def collate(rollouts: list[Rollout], pad_id: int, tokenizer, device) -> dict:
    """Left-pad prompts, right-pad responses; concatenate the media of every row in order."""
    P = max(len(r.prompt.prompt_ids) for r in rollouts)
    R = max(max(len(r.response_ids) for r in rollouts), 1)
    B = len(rollouts)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    mask = torch.zeros((B, R))
    for i, r in enumerate(rollouts):
        p, y = r.prompt.prompt_ids, r.response_ids
        input_ids[i, P - len(p):P], input_ids[i, P:P + len(y)] = torch.tensor(p), torch.tensor(y, dtype=torch.long)
        attn[i, P - len(p):P + len(y)] = 1
        mask[i, :len(y)] = 1
    keys = sorted({k for r in rollouts for k in r.prompt.mm})
    mm = {k: torch.cat([r.prompt.mm[k] for r in rollouts if k in r.prompt.mm]).to(device) for k in keys}
    input_ids = input_ids.to(device)
    return dict(input_ids=input_ids, attention_mask=attn.to(device), mask=mask.to(device), mm=mm,
                response_ids=input_ids[:, P:], mm_token_type_ids=mm_token_types(input_ids, tokenizer))


def offline_rollout(prompt: data.Prompt, tokenizer, eos_id: int, max_len: int) -> Rollout:
    """The sample's curated trajectory as a rollout: its tokens + EOS (so the policy learns to stop),
    truncated to the response budget like any sampled completion."""
    text = prompt.sample["offline_output"]
    ids = (tokenizer.encode(text, add_special_tokens=False) + [eos_id])[:max_len]
    return Rollout(prompt, ids, None, text, "offline")


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


def gather(obj):
    """All ranks' objects, in rank order (small metric dicts only)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def evaluate_accuracy(engine, prompts: list, cfg: Config, rank: int, world: int) -> float:
    """Greedy held-out accuracy (the accuracy reward component), over all ranks."""
    share, start, k = tp_share(prompts, rank, world, cfg.rollout_tp)
    outs = engine.generate(share, n=1, temperature=0.0, max_tokens=cfg.max_response_len)[start:start + k]
    accs = [rewards.compute_reward(r.text, r.prompt.sample, cfg.w_acc, cfg.w_fmt, cfg.format_template)[1]["accuracy"]
            for r in outs]
    allv = [a for part in gather(accs) for a in part]
    return sum(allv) / max(1, len(allv))


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
def main(cfg: Config):
    rank, world, device = init_dist()
    torch.manual_seed(cfg.seed)
    assert cfg.prompts_per_step % world == 0, "prompts_per_step must be divisible by the world size"
    assert world % cfg.rollout_tp == 0, "world size must be divisible by rollout_tp"
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
    eos_ids = model.generation_config.eos_token_id
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    banned = vision_token_ids(tok)
    if cfg.rollout == "vllm":
        engine = VLLMEngine(cfg.model, tok, tp=cfg.rollout_tp, max_model_len=cfg.max_model_len,
                            gpu_memory_utilization=cfg.gpu_memory_utilization, sleep=cfg.vllm_sleep,
                            seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
        engine.sync(model)  # from the first step on, the engine and the trainer hold the same weights
    else:
        engine = HFEngine(model, tok, eos_ids)
    stats = {"cache_hit": 0, "cache_miss": 0, "decode": 0, "decode_s": 0.0}
    prep = lambda s: data.prepare(s, processor, cfg, stats, template)  # noqa: E731
    val_prompts = [prep(s) for s in val_samples]
    rows, wb = [], None
    if rank == 0 and cfg.wandb_project:
        import wandb
        wb = wandb.init(project=cfg.wandb_project, config=asdict(cfg), dir=cfg.out_dir,
                        mode="online" if os.environ.get("WANDB_API_KEY") else "offline")
    acc_before = evaluate_accuracy(engine, val_prompts, cfg, rank, world) if val_prompts else float("nan")
    print0(f"step 0 | held-out accuracy {acc_before:.3f} | {len(train_samples)} train, {len(val_prompts)} val, "
           f"{len(skipped)} skipped | world {world} | rollout {cfg.rollout} tp={cfg.rollout_tp}")
    order, cursor = [], 0
    g = torch.Generator().manual_seed(cfg.seed)
    for step in range(1, cfg.max_steps + 1):
        t0 = time.time()
        # ------------------------------------------------------------------ sample
        batch = []
        while len(batch) < cfg.prompts_per_step:
            if cursor == len(order):  # new epoch: the same permutation on every rank (same generator)
                order, cursor = torch.randperm(len(train_samples), generator=g).tolist(), 0
            batch.append(train_samples[order[cursor]])
            cursor += 1
        before = dict(stats)
        share, start, k = tp_share(batch, rank, world, cfg.rollout_tp)
        prompts = [prep(s) for s in share]
        t_data = time.time() - t0
        rollouts = engine.generate(prompts, cfg.group_size, cfg.temperature, cfg.max_response_len)
        rollouts = rollouts[start * cfg.group_size:(start + k) * cfg.group_size]  # this rank's groups
        engine.sleep()
        t_gen = time.time() - t0 - t_data
        # ------------------------------------------------------------------ offline swap
        if cfg.mix_offline:
            for i in range(k):
                p = rollouts[i * cfg.group_size].prompt
                if p.sample.get("offline_output"):
                    rollouts[(i + 1) * cfg.group_size - 1] = offline_rollout(p, tok, eos_ids[0], cfg.max_response_len)
        # ------------------------------------------------------------------ reward
        scored = [rewards.compute_reward(r.text, r.prompt.sample, cfg.w_acc, cfg.w_fmt, cfg.format_template)
                  for r in rollouts]
        reward = torch.tensor([s[0] for s in scored], dtype=torch.float32)
        # ------------------------------------------------------------------ advantage
        adv = group_advantages(reward, cfg.group_size, cfg.adv_eps).to(device)  # groups never span ranks
        # ------------------------------------------------------------------ log-probs and loss
        t1 = time.time()
        n_tok = torch.tensor(float(sum(len(r.response_ids) for r in rollouts)), device=device)
        if dist.is_initialized():
            dist.all_reduce(n_tok)  # token-mean over the global batch: each rank divides by the global count
        mbs = [list(range(i, min(i + cfg.micro_batch_size, len(rollouts)))) for i in range(0, len(rollouts), cfg.micro_batch_size)]
        batches = [collate([rollouts[j] for j in mb], tok.pad_token_id, tok, device) for mb in mbs]
        old_logps, ref_logps = [], []
        if cfg.ppo_epochs > 1 or ref is not None:
            with torch.no_grad():
                for b in batches:
                    old_logps.append(token_logp(model, b, cfg.temperature, banned)[0] if cfg.ppo_epochs > 1 else None)
                    ref_logps.append(token_logp(ref, b, cfg.temperature, banned)[0] if ref is not None else None)
        m = {"loss": 0.0, "clipfrac": 0.0, "kl": 0.0, "entropy": 0.0, "mismatch_sum": 0.0, "mismatch_max": 0.0, "mismatch_n": 0.0}
        for group_param in opt.param_groups:
            group_param["lr"] = lr_at(step - 1, cfg)
        for epoch in range(cfg.ppo_epochs):
            for i, (mb, b) in enumerate(zip(mbs, batches)):
                logp, ent = token_logp(model, b, cfg.temperature, banned)
                old = old_logps[i] if old_logps and old_logps[i] is not None else logp.detach()
                pl, clipped = policy_loss(logp, old, adv[mb], cfg.clip_low, cfg.clip_high)
                loss_tok = pl
                if ref is not None:
                    kl = kl_k3(logp, ref_logps[i])
                    loss_tok = loss_tok + cfg.kl_coef * kl
                    m["kl"] += masked_sum(kl.detach(), b["mask"]).item()
                # FSDP averages gradients over ranks: scale by world so the result is sum / global tokens
                loss = masked_sum(loss_tok, b["mask"]) / n_tok * world
                loss.backward()
                if epoch == 0:
                    m["loss"] += loss.item() / world
                    m["clipfrac"] += masked_sum(clipped, b["mask"]).item()
                    m["entropy"] += masked_sum(ent.detach(), b["mask"]).item()
                    for row, j in enumerate(mb):  # health: sampler vs trainer log-probs on the same tokens
                        lp = rollouts[j].logp
                        if lp:
                            d = (logp[row, :len(lp)].detach().cpu() - torch.tensor(lp)).abs()
                            m["mismatch_sum"] += d.sum().item()
                            m["mismatch_n"] += len(lp)
                            m["mismatch_max"] = max(m["mismatch_max"], d.max().item())
            # ---------------------------------------------------------------- step
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
            opt.step()
            opt.zero_grad(set_to_none=True)
        t_train = time.time() - t1
        # ------------------------------------------------------------------ sync
        t2 = time.time()
        engine.sync(model)
        t_sync = time.time() - t2
        # ------------------------------------------------------------------ log
        local = {
            "reward": reward.tolist(), "types": [rewards.canonical_type(r.prompt.sample["problem_type"]) for r in rollouts],
            "comp": [s[1] for s in scored], "len": [len(r.response_ids) for r in rollouts],
            "offline": [r.finish == "offline" for r in rollouts], "adv": adv.tolist(), "truncated": [r.finish == "length" for r in rollouts],
            "m": m, "stats": {k2: stats[k2] - before[k2] for k2 in stats},
        }
        parts = gather(local)
        if rank == 0:
            row = step_metrics(parts, step, cfg, float(gnorm), lr_at(step - 1, cfg), n_tok.item(),
                               dict(data=t_data, gen=t_gen, train=t_train, sync=t_sync, step=time.time() - t0))
            row["data/skipped"] = len(skipped)
        # ------------------------------------------------------------------ eval / save
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps and val_prompts:
            acc = evaluate_accuracy(engine, val_prompts, cfg, rank, world)
            if rank == 0:
                row["eval/accuracy"] = acc
        if rank == 0:
            rows.append(row)
            print0(" | ".join([f"step {step}"] + [f"{k2} {v:.4g}" for k2, v in row.items() if k2 in LOG_KEYS]))
            with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            if wb:
                wb.log(row, step=step)
    acc_after = evaluate_accuracy(engine, val_prompts, cfg, rank, world) if val_prompts else float("nan")
    if rank == 0 and rows:
        rows[-1]["eval/accuracy"] = acc_after
        rows.insert(0, {"step": 0, "reward/mean": float("nan"), "reward/accuracy": float("nan"), "eval/accuracy": acc_before})
        plot_curve(rows, os.path.join(cfg.out_dir, "curve.png"))
        if skipped:
            with open(os.path.join(cfg.out_dir, "skipped.jsonl"), "w") as f:
                f.writelines(json.dumps(s) + "\n" for s in skipped)
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
    for key in ("accuracy", "format", "parse_fail"):
        row[f"reward/{key}"] = mean([c[key] for c in comp])
        for t in sorted(set(types)):
            row[f"reward/{key}/{t}"] = mean([c[key] for c, ty in zip(comp, types) if ty == t])
    g = [rew[i:i + cfg.group_size] for i in range(0, len(rew), cfg.group_size)]
    row["zero_std_groups"] = mean([float(max(x) == min(x)) for x in g])
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

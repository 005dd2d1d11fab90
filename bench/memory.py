"""Peak memory of the train phase on long videos: the trainer before issue 13, each memory switch alone, all of them.

    .venv/bin/python bench/memory.py          # ~15 min on 2 shared cores

The tiny Qwen2.5-VL, `prompts` synthetic 256-frame clips (112 x 112: 8,192 vision patches, a 2,100-token prompt),
group_size rollouts each with max_response_len random tokens, all rows in one micro-batch unless the token budget
splits them. Each setting runs in a fresh process (`--worker`): it loads the model, prepares the prompts, then
runs the train phase of train.main once (micro-batches, the frozen features, micro_loss + backward per
micro-batch, clipping, the AdamW step) and reports its peak memory, its time, and the videos the vision tower
encoded (a forward pre-hook on the tower). Peak memory: the peak resident set of that phase above the resident set
at its start (Linux VmHWM reset through /proc/self/clear_refs, glibc's mmap threshold pinned so freed tensors
leave the resident set; memory_plan.peak_bytes). "before #13" is train.py as it was before issue 13 (BEFORE).
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
BEFORE = "5e47fd9"  # the last commit before issue 13: train.py encoded the media of every row
OFF = dict(freeze_vision=False, gradient_checkpointing=False, logp_chunk=0, max_tokens_per_micro_batch=0)
SETTINGS = {"before #13": {}, "switches off": OFF, "freeze_vision": dict(OFF, freeze_vision=True),
            "gradient_checkpointing": dict(OFF, gradient_checkpointing=True),
            "logp_chunk 64": dict(OFF, logp_chunk=64),
            "max_tokens_per_micro_batch 704": dict(OFF, max_tokens_per_micro_batch=704),
            "all on": dict(freeze_vision=True, gradient_checkpointing=True, logp_chunk=64,
                           max_tokens_per_micro_batch=704)}


@dataclass
class Config:
    frames: int = 256
    """frames per clip (8 fps: frames / 8 seconds)"""
    size: int = 56
    """frame side in pixels (video_max_pixels = size^2)"""
    prompts: int = 2
    """prompts (clips) in the step"""
    group_size: int = 4
    """rollouts per prompt"""
    response_len: int = 64
    """response tokens per rollout"""
    worker: str = ""
    """run one setting of SETTINGS in this process and print its JSON line (internal)"""
    out: str = os.path.join(ROOT, ".cache/bench/memory")
    """clips and the train.py of BEFORE go here"""


def train_config(c: Config, **switches):
    import train
    return train.Config(model=os.path.join(ROOT, ".cache/models/tiny-qwen2_5_vl"), video_fps=8.0,
                        video_max_frames=c.frames, video_min_pixels=3136, video_max_pixels=c.size ** 2,
                        max_prompt_len=640, cache_dir="", video_source="decode_only", group_size=c.group_size,
                        prompts_per_step=c.prompts, max_response_len=c.response_len,
                        micro_batch_size=c.prompts * c.group_size, **switches)


def train_phase(train, model, opt, rollouts: list, cfg, tok, banned: list[int]):
    """train.main's train phase for one rollout batch (advantages +-1), on this process's CPU."""
    mini = train.micro_batches(rollouts, cfg, tok, model.device, None)[0]
    if getattr(cfg, "freeze_vision", False):  # BEFORE's train.py has no such field
        frozen = train.sp.encode_vision(model, [r.prompt for r in rollouts], model.device)[0]
        for b in mini:
            b["vision"] = frozen
    n_tok, n_seq = train.global_counts(mini)
    for b in mini:
        b["adv"] = (torch.tensor(b["index"]) % 2 * 2.0 - 1)[:, None].expand_as(b["mask"])
        train.micro_loss(model, b, cfg, banned, n_tok=n_tok, n_seq=n_seq)[0].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(c: Config) -> dict:
    """One setting in this fresh process: {"peak": bytes, "time": s, "encodes": videos encoded, "prompt", "patches"}."""
    import data
    import memory_plan  # puts ROOT first on sys.path
    if c.worker == "before #13":
        sys.path.insert(0, c.out)  # the train.py of commit BEFORE
    import train
    from rollout import Rollout, vision_token_ids
    from transformers import AutoProcessor
    cfg = train_config(c, **SETTINGS[c.worker])
    processor = AutoProcessor.from_pretrained(cfg.model)
    model = train.load_model(cfg, torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    prompts = [data.prepare(s, processor, cfg) for s in data.load_samples(os.path.join(c.out, "clips/train.jsonl"))]
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout(p, torch.randint(20, 400, (c.response_len,), generator=g).tolist(), None, "", "length")
                for p in prompts[:c.prompts] for _ in range(c.group_size)]
    encodes = []
    model.model.visual.register_forward_pre_hook(count_videos(encodes), with_kwargs=True)
    t0 = time.time()
    peak = memory_plan.peak_bytes(train_phase, train, model, opt, rollouts, cfg, processor.tokenizer,
                                  vision_token_ids(processor.tokenizer))
    return dict(peak=peak, time=time.time() - t0, encodes=sum(encodes), prompt=len(prompts[0].prompt_ids),
                patches=int(prompts[0].mm["video_grid_thw"].prod()))


def count_videos(counts: list):
    def hook(module, args, kwargs):
        counts.append(len(kwargs.get("grid_thw", args[1] if len(args) > 1 else [])))
    return hook


def run(c: Config, setting: str) -> dict:
    """worker() in a fresh process."""
    cmd = [sys.executable, __file__, "--worker", setting, "--frames", str(c.frames), "--size", str(c.size),
           "--prompts", str(c.prompts), "--group-size", str(c.group_size), "--response-len", str(c.response_len),
           "--out", c.out]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if p.returncode:
        sys.exit(f"{setting} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.splitlines()[-1])


def prepare(c: Config):
    """The clips and the tiny model, and the train.py of BEFORE in c.out."""
    import make_synthetic_data
    import make_tiny_model
    make_tiny_model.ensure("qwen2_5_vl", root=os.path.join(ROOT, ".cache/models"))
    make_synthetic_data.make(os.path.join(c.out, "clips"), ["color"], num_train=c.prompts, num_val=0, seed=0,
                             size=c.size, fps=8, seconds=c.frames / 8)
    with open(os.path.join(c.out, "train.py"), "w") as f:
        f.write(subprocess.run(["git", "show", f"{BEFORE}:train.py"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout)


def main(c: Config):
    prepare(c)
    load = os.getloadavg()[0]
    print(f"{c.prompts} clips x {c.frames} frames {c.size}x{c.size}, group_size {c.group_size}, {c.response_len} "
          f"response tokens; load average {load:.1f} on {os.cpu_count()} cores (timings are noisy)")
    print("| setting | peak memory | step time | vision encodes per step |\n|---|---|---|---|")
    rows = {}
    for setting in SETTINGS:
        rows[setting] = r = run(c, setting)
        print(f"| {setting} | {r['peak'] / 2 ** 20:.0f} MiB | {r['time']:.1f} s | {r['encodes']} |", flush=True)
    before, after = rows["before #13"], rows["all on"]
    print(f"vision encodes per step: {before['encodes']} -> {after['encodes']}")
    print(f"peak memory ratio: {before['peak'] / after['peak']:.1f}x")


if __name__ == "__main__":
    import tyro
    config = tyro.cli(Config)
    if config.worker:
        print(json.dumps(worker(config)))
    else:
        main(config)

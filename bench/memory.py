"""Peak memory of the train phase on long videos: the trainer before issue 13, each memory switch alone, all of them.

    .venv/bin/python bench/memory.py          # ~15 min on 2 shared cores

The tiny Qwen2.5-VL, `prompts` synthetic clips, group_size rollouts of response_len random tokens each. A fresh
process per setting (`--worker`) loads the model (and with kl_coef the reference) and runs train.main's step after
generation `steps` times (train_phase): the last one's peak memory (peak_bytes), time and videos encoded (pre-hooks on
the vision towers). "before #13": train.py before issue 13 (BEFORE). bench/long_video.py runs this worker too.
"""
import ctypes
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
BEFORE = "5e47fd9"  # the last commit before issue 13: train.py encoded the media of every row
OFF = dict(freeze_vision=False, gradient_checkpointing=False, logp_chunk=0, max_tokens_per_micro_batch=0)
SETTINGS = {"before #13": {}, "switches off": OFF, "freeze_vision": dict(OFF, freeze_vision=True),
            "gradient_checkpointing": dict(OFF, gradient_checkpointing=True), "logp_chunk 64": dict(OFF, logp_chunk=64),
            "max_tokens_per_micro_batch 704": dict(OFF, max_tokens_per_micro_batch=704), "all on": dict(
                freeze_vision=True, gradient_checkpointing=True, logp_chunk=64, max_tokens_per_micro_batch=704)}


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
    ranks: int = 1
    """worker processes (> 1: torchrun, gloo), 2 / ranks threads each; data-parallel ranks x sp_size"""
    sp_size: int = 1
    """sequence-parallel ranks (train.Config.sp_size): an SP group's ranks train the same clips, 1/sp_size of each"""
    kl_coef: float = 0.0
    """> 0: a reference model and its log-prob pass before the update, as train.main runs it (EasyR1: 1e-2)"""
    steps: int = 1
    """train phases run; > 1: the first is left out (one-time costs, e.g. library code paged in), the rest give the
    largest peak and the fastest time"""
    worker: str = ""
    """run one setting of SETTINGS in this process and print its JSON line (internal)"""
    out: str = os.path.join(ROOT, ".cache/bench/memory")
    """clips and the train.py of BEFORE go here"""


def train_config(c: Config, trainer=None, **switches):
    """The Config of this benchmark's clips and batch, from the module `trainer` (today's train.py by default)."""
    import train
    return (trainer or train).Config(
        model=os.path.join(ROOT, ".cache/models/tiny-qwen2_5_vl"), video_fps=8.0, video_max_frames=c.frames,
        video_min_pixels=3136, video_max_pixels=c.size ** 2, max_prompt_len=32768, cache_dir="",
        video_source="decode_only", group_size=c.group_size, prompts_per_step=c.prompts,
        max_response_len=c.response_len, micro_batch_size=c.prompts * c.group_size, kl_coef=c.kl_coef, **switches)


def train_phase(train, model, ref, opt, rollouts: list, cfg, tok, banned: list[int], layout=None):
    """train.main's step after generation (advantages +-1; one epoch, one mini-batch: no old log-prob pass) on this
    process's CPU: the frozen features, the reference pass (ref None: kl_coef 0), the update; layout: sp.Layout."""
    import sp
    mini = train.micro_batches(rollouts, cfg, tok, model.device, None)[0]
    today = hasattr(cfg, "sp_size")  # BEFORE's token_logp and micro_loss take neither logp_chunk nor a layout
    logp_args = (cfg.logp_chunk, layout) if today else ()
    with torch.no_grad():
        frozen = None
        if getattr(cfg, "freeze_vision", False):  # BEFORE's train.py has no such field
            frozen = sp.encode_vision(model, [r.prompt for r in rollouts], model.device, layout)
        for b in mini:
            b["vision"] = frozen
            if ref is not None:  # train.reference_logp with a reference model is this call
                b["ref_logp"] = train.token_logp(ref, b, cfg.temperature, banned, *logp_args)[0]
    n_tok, n_seq = train.global_counts(mini)  # SP: each row counted sp_size times, a loss scale (free)
    sp_kw = {"layout": layout} if today else {}
    for b in mini:
        b["adv"] = (torch.tensor(b["index"]) % 2 * 2.0 - 1)[:, None].expand_as(b["mask"])
        train.micro_loss(model, b, cfg, banned, n_tok=n_tok, n_seq=n_seq, **sp_kw)[0].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def status_kib(key: str) -> int:
    """A /proc/self/status value in KiB."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(key + ":")))


def peak_bytes(fn, *args) -> int:
    """fn(*args)'s peak resident-set rise (VmHWM after clear_refs) less the file-backed pages (library code) it read."""
    ctypes.CDLL(None).mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: large frees return to the OS, never parked in a heap
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base, file = status_kib("VmRSS"), status_kib("RssFile")
    fn(*args)
    return (status_kib("VmHWM") - base - status_kib("RssFile") + file) * 1024


def worker(c: Config) -> dict:
    """One setting in this fresh process (one of sp_size ranks): {"peak": bytes, "time": s, "encodes": videos encoded
    per step, "prompt": tokens, "patches", "params"}."""
    import data
    import sp
    import train
    from rollout import Rollout, vision_token_ids
    from transformers import AutoProcessor
    trainer, switches = train, dict(SETTINGS[c.worker], sp_size=c.sp_size)
    if c.worker == "before #13":  # BEFORE's train.py (no switches) trains; today's data.py prepares the prompts
        spec = importlib.util.spec_from_file_location("train_before", os.path.join(c.out, "train.py"))
        trainer = sys.modules["train_before"] = importlib.util.module_from_spec(spec)
        switches = {}
        spec.loader.exec_module(trainer)
    rank, world, _ = train.init_dist()
    layout = sp.make_layout(c.sp_size)
    cfg = train_config(c, trainer, **switches)
    processor = AutoProcessor.from_pretrained(cfg.model)
    model = trainer.load_model(cfg, torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    samples = data.load_samples(os.path.join(c.out, f"clips{c.frames}x{c.size}/train.jsonl"))
    prompts = [data.prepare(s, processor, train_config(c)) for s in samples]
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout(p, torch.randint(20, 400, (c.response_len,), generator=g).tolist(), None, "", "length")
                for p in prompts[:c.prompts][rank // c.sp_size::world // c.sp_size] for _ in range(c.group_size)]
    models, ref = [model], None
    if c.kl_coef:  # train.main's reference model: its tower encodes too unless the features are frozen
        ref = trainer.load_model(cfg, torch.device("cpu")).eval().requires_grad_(False)
        models.append(ref)
    encodes = []  # the videos each call of a vision tower encodes (HF calls it with grid_thw, a row per video)
    for m in models:
        m.model.visual.register_forward_pre_hook(lambda _, args, kw: encodes.append(len(kw["grid_thw"])),
                                                 with_kwargs=True)
    peaks, times = [], []
    for _ in range(c.steps):
        t0 = time.time()
        peaks.append(peak_bytes(train_phase, trainer, model, ref, opt, rollouts, cfg, processor.tokenizer,
                                vision_token_ids(processor.tokenizer), layout))
        times.append(time.time() - t0)
    # steps after the first (one-time costs): the largest peak, the fastest time (the least slowed by other processes)
    peaks, times = peaks[1:] or peaks, times[1:] or times
    return dict(peak=max(peaks), time=min(times), encodes=sum(encodes) // c.steps, prompt=len(prompts[0].prompt_ids),
                patches=int(prompts[0].mm["video_grid_thw"].prod()), params=sum(p.numel() for p in model.parameters()))


def run(c: Config, setting: str) -> dict:
    """worker() in a fresh process, or c.ranks under torchrun sharing 2 threads: the peak and time of the rank that
    rose the most and took the longest."""
    launch = [sys.executable]
    if c.ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={c.ranks}"]
    args = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(replace(c, worker=setting)).items()]
    p = subprocess.run(launch + [__file__, *args], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS=str(max(1, 2 // c.ranks))))
    if p.returncode:
        sys.exit(f"{setting} ({c.ranks} ranks, sp_size {c.sp_size}, {c.frames} frames) failed:\n{p.stderr[-3000:]}")
    ranks = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('{"peak"')]
    return dict(ranks[0], peak=max(r["peak"] for r in ranks), time=max(r["time"] for r in ranks))


def prepare(c: Config):
    """The tiny model, the clips (a folder per frame count and size: each written once) and BEFORE's train.py."""
    import make_synthetic_data
    import make_tiny_model
    make_tiny_model.ensure("qwen2_5_vl", root=os.path.join(ROOT, ".cache/models"))
    make_synthetic_data.make(os.path.join(c.out, f"clips{c.frames}x{c.size}"), ["color"], num_train=c.prompts,
                             num_val=0, seed=0, size=c.size, fps=8, seconds=c.frames / 8)
    with open(os.path.join(c.out, "train.py"), "w") as f:
        f.write(subprocess.run(["git", "show", f"{BEFORE}:train.py"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout)


def main(c: Config):
    prepare(c)
    print(f"{c.prompts} clips x {c.frames} frames {c.size}x{c.size}, group_size {c.group_size}, {c.response_len} "
          f"response tokens; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings are noisy)")
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
        sys.stdout.write(json.dumps(worker(config)) + "\n")  # one write: ranks share the pipe (PYTHONUNBUFFERED)
    else:
        main(config)

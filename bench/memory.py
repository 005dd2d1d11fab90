"""Peak memory of the train phase on long videos: every memory switch off (each row encoded), each alone, all on.

    .venv/bin/python bench/memory.py          # ~15 min on 2 shared cores

The tiny Qwen2.5-VL, `prompts` synthetic clips, group_size rollouts of response_len random tokens each. A fresh
process per setting (`--worker`) loads the model (and with kl_coef the reference) and runs train.main's step after
generation `steps` times (train.train_phase: the log-prob pass, advantages, train.update): the last one's peak memory
(mark, rise), time and videos encoded (pre-hooks on the vision towers). "each row encoded" is the trainer before
issue 13 as a setting of today's: every switch off and each row its own copy of its prompt, so every pass encodes
every row's video (the tower trained) as train.py did then. bench/long_video.py runs this worker too.
"""

import copy
import ctypes
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from harness import ROOT, launch, torchrun

OFF = dict(
    freeze_vision=False, gradient_checkpointing=False, logp_chunk=0, max_tokens_per_micro_batch=0
)
PER_ROW = "each row encoded"  # OFF, and no two rows share a Prompt: the vision tower runs on every row in every pass
SETTINGS = {
    PER_ROW: OFF,
    "switches off": OFF,
    "freeze_vision": dict(OFF, freeze_vision=True),
    "gradient_checkpointing": dict(OFF, gradient_checkpointing=True),
    "logp_chunk 64": dict(OFF, logp_chunk=64),
    "max_tokens_per_micro_batch 704": dict(OFF, max_tokens_per_micro_batch=704),
    "all on": dict(
        freeze_vision=True,
        gradient_checkpointing=True,
        logp_chunk=64,
        max_tokens_per_micro_batch=704,
    ),
}


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
    """the clips go here"""


def train_config(c: Config, **switches):
    """The train.Config of this benchmark's clips and batch."""
    import train

    return train.Config(
        model=os.path.join(ROOT, ".cache/models/tiny-qwen2_5_vl"),
        video_fps=8.0,
        video_max_frames=c.frames,
        video_max_pixels=c.size**2,
        max_prompt_len=32768,
        cache_dir="",
        video_source="decode_only",
        group_size=c.group_size,
        prompts_per_step=c.prompts,
        max_response_len=c.response_len,
        micro_batch_size=c.prompts * c.group_size,
        kl_coef=c.kl_coef,
        **switches,
    )


def train_phase(t, rollouts: list, cfg, tok):
    """train.train_phase, train.main's step after generation, on this process's CPU (t: a train.Trainer; rewards
    alternating 1, 0 by row): the log-prob pass (frozen features, the reference's), advantages, train.update."""
    import train

    rows = dict(
        reward=[float(i % 2) for i in range(len(rollouts))],
        length=[len(r.response_ids) for r in rollouts],
        baseline=[0.0] * len(rollouts),
    )
    train.train_phase(t, rollouts, rows, 0, cfg, tok, step=1, ids=[])


def status_kib(key: str) -> int:
    """A /proc/self/status value in KiB."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(key + ":")))


def mark() -> int:
    """Resets VmHWM to the current resident set (clear_refs), glibc's mmap threshold pinned (M_MMAP_THRESHOLD: large
    frees return to the OS, never parked in a heap); returns the anonymous resident set in KiB, for rise()."""
    ctypes.CDLL(None).mallopt(-3, 1 << 16)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS") - status_kib("RssFile")


def rise(base: int) -> int:
    """Bytes the resident set peaked above mark()'s `base`, less the file-backed pages (library code) read since."""
    return (status_kib("VmHWM") - status_kib("RssFile") - base) * 1024


def prompts(c: Config, processor, cfg) -> list:
    """The prepared prompts of c's clips (prepare() wrote them)."""
    import data

    samples = data.load_samples(os.path.join(c.out, f"clips{c.frames}x{c.size}/train.jsonl"))
    return [data.prepare(s, processor, cfg) for s in samples[: c.prompts]]


def rollouts(c: Config, prompts: list, copies: bool = False) -> list:
    """group_size rollouts of response_len random tokens per prompt (copies: each with its own copy of its Prompt,
    so that no two rows share one)."""
    from rollout import Rollout

    g = torch.Generator().manual_seed(0)
    return [
        Rollout(
            copy.copy(p) if copies else p,
            torch.randint(20, 400, (c.response_len,), generator=g).tolist(),
            None,
            "",
            "length",
        )
        for p in prompts
        for _ in range(c.group_size)
    ]


def worker(c: Config) -> dict:
    """One setting in this fresh process (one of sp_size ranks): {"peak": bytes, "time": s, "encodes": videos encoded
    per step, "prompt": tokens, "patches", "params"}."""
    import sp
    import train
    from transformers import AutoProcessor

    rank, world = train.init_dist()[:2]
    cfg = train_config(c, **SETTINGS[c.worker], sp_size=c.sp_size)
    processor = AutoProcessor.from_pretrained(cfg.model)
    t = train.build_trainer(cfg, processor, sp.make_layout(c.sp_size), torch.device("cpu"))
    t = replace(t, dummies=None)  # every rank's rows hold a video: no dummy image rows needed
    if c.worker == PER_ROW:  # the trainer before: the reference's features encoded in every step
        t = replace(t, ref_features=sp.FeatureCache(max_bytes=0))
    ps = prompts(c, processor, cfg)
    rows = rollouts(c, ps[rank // c.sp_size :: world // c.sp_size], copies=c.worker == PER_ROW)
    encodes = []  # the videos of each call of a vision tower
    for m in (t.model, t.ref):  # the reference's tower encodes too (features not frozen)
        if m is not None:
            count_videos(m.model.visual, encodes)
    peaks = []
    times = []
    for _ in range(c.steps):
        gc.collect()  # the last step's garbage is not this one's peak
        t0 = time.time()
        base = mark()
        train_phase(t, rows, cfg, processor.tokenizer)
        peaks.append(rise(base))
        times.append(time.time() - t0)
    # steps after the first (one-time costs): the largest peak, the fastest time (the least slowed by other processes)
    peaks, times = peaks[1:] or peaks, times[1:] or times
    return dict(
        peak=max(peaks),
        time=min(times),
        encodes=sum(encodes) // c.steps,
        prompt=len(ps[0].prompt_ids),
        patches=int(ps[0].mm["video_grid_thw"].prod()),
        params=sum(p.numel() for p in t.model.parameters()),
    )


def count_videos(tower, out: list):
    """Appends to `out` the videos of each call of the vision tower (HF passes grid_thw, a row per video)."""
    tower.register_forward_pre_hook(
        lambda _, args, kw: out.append(len(kw["grid_thw"])), with_kwargs=True
    )


def run(c: Config, setting: str) -> dict:
    """worker() in a fresh process, or c.ranks under torchrun sharing 2 threads: the peak and time of the rank that
    rose the most and took the longest."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(replace(c, worker=setting)).items()]
    cmd = [sys.executable, __file__, *args]
    if c.ranks > 1:
        cmd = torchrun(c.ranks, __file__, *args)
    what = f"{setting} ({c.ranks} ranks, sp_size {c.sp_size}, {c.frames} frames)"
    out = launch(cmd, what, OMP_NUM_THREADS=str(max(1, 2 // c.ranks)))
    ranks = [json.loads(line) for line in out.splitlines() if line.startswith('{"peak"')]
    return dict(ranks[0], peak=max(r["peak"] for r in ranks), time=max(r["time"] for r in ranks))


def prepare(c: Config):
    """The tiny model and the clips (a folder per frame count and size: each written once)."""
    import make_synthetic_data
    import make_tiny_model

    make_tiny_model.ensure("qwen2_5_vl")
    make_synthetic_data.make(
        os.path.join(c.out, f"clips{c.frames}x{c.size}"),
        ["color"],
        num_train=c.prompts,
        num_val=0,
        size=c.size,
        fps=8,
        seconds=c.frames / 8,
    )


def main(c: Config):
    prepare(c)
    print(
        f"{c.prompts} clips x {c.frames} frames {c.size}x{c.size}, group_size {c.group_size}, {c.response_len} "
        f"response tokens; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings are noisy)"
    )
    print("| setting | peak memory | step time | vision encodes per step |\n|---|---|---|---|")
    rows = {}
    for setting in SETTINGS:
        rows[setting] = r = run(c, setting)
        print(
            f"| {setting} | {r['peak'] / 2**20:.0f} MiB | {r['time']:.1f} s | {r['encodes']} |",
            flush=True,
        )
    print(f"vision encodes per step: {rows[PER_ROW]['encodes']} -> {rows['all on']['encodes']}")
    print(f"peak memory ratio: {rows[PER_ROW]['peak'] / rows['all on']['peak']:.1f}x")


if __name__ == "__main__":
    import tyro

    config = tyro.cli(Config)
    if config.worker:
        sys.stdout.write(
            json.dumps(worker(config)) + "\n"
        )  # one write: ranks share the pipe (PYTHONUNBUFFERED)
    else:
        main(config)

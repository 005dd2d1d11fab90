"""What the frame cache buys on 1280x720 30 fps clips, one of each duration: per-sample load and prepare, and 2-rank
train steps of the tiny model, decode_only vs the warm cache, at Video-R1's frame setting (FRAMES; method:
docs/speed.md). Last line: `cache step speedup: <ratio>x`.

    .venv/bin/python bench/cache.py          # about 5 minutes on 2 cores (--steps 6 --seconds 30 60 90 120)
"""

import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, replace

from harness import ROOT, train
import cache
import cache_frames
from common import write_jsonl

# Video-R1's training sampling (2 fps, <= 16 frames) at tiny_cpu.yaml's pixel budget (3136: the minimum too), the
# rest cache.Frames' defaults (2 fps, 4 frames at least); FLAGS: the same for train.py
FRAMES = cache.Frames(video_max_frames=16, video_max_pixels=3136)
FLAGS = [x for k, v in asdict(FRAMES).items() for x in (f"--{k.replace('_', '-')}", str(v))]
BIG = replace(FRAMES, video_max_frames=64, video_max_pixels=262144)  # qwen2_5_vl_7b.yaml's
ENV = dict(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # vLLM's CPU KV cache: rollout.py


def make_clips(out: str, seconds: tuple[int, ...]) -> tuple[str, list[str]]:
    """One 720p 30 fps clip per duration (kept between runs); returns a train.jsonl listing them all, and the clips."""
    import make_synthetic_data

    rows = []
    for s in seconds:
        d = os.path.join(out, f"{s}s")
        paths = make_synthetic_data.make(
            d, ["color"], num_train=1, num_val=0, seed=s, width=1280, height=720, fps=30, seconds=s
        )
        row = json.loads(open(paths["train"]).readline())  # the one sample
        rows.append(dict(row, videos=[os.path.join(d, v) for v in row["videos"]]))
    path = os.path.join(out, "train.jsonl")
    write_jsonl(path, rows)
    return path, [r["videos"][0] for r in rows]


def main(
    seconds: tuple[int, ...] = (30, 60, 90, 120),
    steps: int = 6,
    out: str = os.path.join(ROOT, ".cache/bench/cache"),
):
    """seconds: the clips' durations; steps: train steps per run (the first is not timed); out: clips, cache, runs."""
    out = os.path.abspath(out)  # make_clips' paths are read relative to its JSONL
    import make_tiny_model

    t0 = time.time()
    model = make_tiny_model.ensure("qwen2_5_vl")
    train_jsonl, videos = make_clips(out, seconds)
    print(
        f"{len(videos)} clips 1280x720 30 fps, {seconds} s, tiny model ready ({time.time() - t0:.0f}s)",
        flush=True,
    )

    # ---- 1. the preprocessing command's work (scripts/cache_frames.py), into a cold cache
    frames_dir = os.path.join(out, "frames")
    shutil.rmtree(frames_dir, ignore_errors=True)
    argv = ["--data", train_jsonl, "--out", frames_dir, "--workers", "2", *FLAGS, "--factor", "28"]
    summary = cache_frames.preprocess(cache_frames.load_config(argv))  # what the script runs
    print("cache_frames.py:", " | ".join(f"{k} {v}" for k, v in summary.items()), flush=True)

    # ---- 2. per-sample load time, the same clips and settings (and, for scale, the 7B config's settings)
    cache.load_video(
        videos[0], FRAMES, mode="decode_only"
    )  # untimed: the first call imports decord, torchvision
    lines = []  # (measure, decode_only, warm cache)
    for name, settings, d in (
        ("bench", FRAMES, frames_dir),
        ("qwen2_5_vl_7b", BIG, os.path.join(out, "frames_7b")),
    ):
        decode_s = []
        cached_s = []
        for v in videos:
            t = time.perf_counter()
            ref = cache.load_video(v, settings, mode="decode_only")
            decode_s.append(time.perf_counter() - t)
            cache.load_video(
                v, settings, cache_dir=d
            )  # no preprocessing run at the 7B settings: a first run adds it
            t = time.perf_counter()
            for _ in range(5):
                frames, meta = cache.load_video(v, settings, cache_dir=d, mode="cache_only")
            cached_s.append((time.perf_counter() - t) / 5)
            assert (frames == ref[0]).all() and meta == ref[1], (
                f"{v}: cached frames differ from decoded ones"
            )
        shape = f"{'x'.join(map(str, frames.shape[:3]))} {frames.nbytes / 1e6:.2g}MB"
        lines.append(
            (
                f"load/sample (ms) {name} {shape}",
                1000 * statistics.mean(decode_s),
                1000 * statistics.mean(cached_s),
            )
        )
        print(
            f"per-sample load at {name} settings measured ({sum(decode_s):.0f}s of decoding)",
            flush=True,
        )

    # what train.py does per sample before vLLM: frames + chat template + processor (data.prepare), both ways
    import data
    from train import load_config
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    prep_ms = []
    for src in ("decode_only", "prefer_cache"):
        cfg = load_config(
            [
                "--config",
                os.path.join(ROOT, "configs/tiny_cpu.yaml"),
                "--cache-dir",
                frames_dir,
                "--video-source",
                src,
                *FLAGS,
            ]
        )
        t = time.perf_counter()
        for s in data.load_samples(train_jsonl):
            data.prepare(s, processor, cfg)
        prep_ms.append(1000 * (time.perf_counter() - t) / len(videos))
    lines.append(("prepare/sample (ms): frames+template+processor", *prep_ms))

    # ---- 3. training steps: decode_only vs the warm cache
    runs = {}
    for src in ("decode_only", "prefer_cache"):
        flags = [
            "--model",
            model,
            "--train-data",
            train_jsonl,
            "--prompts-per-step",
            str(len(videos)),
            "--eval-every",
            "0",
            "--cache-dir",
            frames_dir,
            "--video-source",
            src,
            *FLAGS,
        ]
        out_run = os.path.join(out, f"run_{src}")
        runs[src] = train(2, out_run, steps, flags, f"train.py --video-source {src}", **ENV)
    warm_decodes = [r["cache/decode"] for r in runs["prefer_cache"]]
    assert warm_decodes == [0] * steps, (
        f"a warm cache must not decode: cache/decode per step {warm_decodes}"
    )
    # each measure's median over the steps after the first: decode_only's, the warm cache's
    times = ("time/step", "time/data", "time/gen", "time/train", "time/sync")
    keys = [k for k in times if k in runs["prefer_cache"][0]]
    keys += ["cache/decode_s", "cache/decode", "cache/cache_hit"]
    med = {k: [statistics.median(r[k] for r in rows[1:]) for rows in runs.values()] for k in keys}
    for k, (dec, warm) in med.items():
        label = f"train {k} (s, median steps 2-{steps})"
        if k.startswith("cache/"):
            label = f"train {k} per step (all ranks)"
        lines.append((label, dec, warm))
    print(f"\n| {'measure':<52} | {'decode_only':>12} | {'warm cache':>12} | {'ratio':>8} |")
    print(f"|{'-' * 54}|{'-' * 14}|{'-' * 14}|{'-' * 10}|")
    for name, dec, warm in lines:
        ratio = f"{dec / warm:.1f}x" if warm and "cache/" not in name else "-"
        print(f"| {name:<52} | {dec:>12.4g} | {warm:>12.4g} | {ratio:>8} |")
    print(f"\nbench total {time.time() - t0:.0f}s")
    dec, warm = med["time/step"]
    print(f"cache step speedup: {dec / warm:.2f}x")


if __name__ == "__main__":
    import tyro

    tyro.cli(main)

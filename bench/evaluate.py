"""The evaluate.py pipeline (AsyncLLM, warm frame cache, loader threads, many requests in flight) vs a plain loop
(decode, prompt, generate one sample, wait): same tiny model, videos and greedy settings, in one run (method and
clip sizes: docs/speed.md). Last line: `eval speedup: <ratio>x`.

    OMP_NUM_THREADS=1 .venv/bin/python bench/evaluate.py [--samples 64 --width 640 --height 360 --fps 30 --seconds 30]
"""

import asyncio
import os
import shutil
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


def main(
    samples: int = 64,
    width: int = 640,
    height: int = 360,
    fps: float = 30.0,
    seconds: float = 30.0,
    max_tokens: int = 16,
    max_in_flight: int = 64,
):
    """samples over three tasks, on width x height px videos at fps, seconds long (kept between runs)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import make_synthetic_data
    import make_tiny_model
    import evaluate as E

    work = os.path.join(ROOT, ".cache", "bench_eval")
    for sub in ("frames", "plain", "async", "warm1", "warm2"):  # results and cache; the videos stay
        shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    d = os.path.join(work, "ann", "nvr1")
    t = time.perf_counter()
    make_synthetic_data.make(
        d,
        ["color", "count", "direction"],
        num_train=1,
        num_val=samples // 3 + 1,
        seed=0,
        width=width,
        height=height,
        fps=fps,
        seconds=seconds,
    )
    print(f"videos ready ({time.perf_counter() - t:.0f} s)", flush=True)
    model = make_tiny_model.ensure("qwen2_5_vl", root=os.path.join(ROOT, ".cache/models"))
    cfg = E.Config(
        model=model,
        benchmarks="nvr1",
        data_dir=os.path.join(work, "ann"),
        video_dir=work,
        max_samples=samples,
        max_tokens=max_tokens,
        max_model_len=2048,
        max_prompt_len=2048,
        video_fps=2.0,
        video_min_frames=4,
        video_max_frames=16,
        video_max_pixels=12544,
        cache_dir=os.path.join(work, "frames"),
        max_in_flight=max_in_flight,
    )
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)

    async def timed(c: E.Config, warmup_dir: str) -> tuple[dict, float]:
        """c's results and seconds, after a 4-sample warm-up (and with a cache, every video decoded once)."""
        engine = E.make_engine(c, processor.tokenizer)
        try:
            warmup = replace(c, max_samples=4, out_dir=os.path.join(work, warmup_dir))
            await E.evaluate(warmup, engine, processor)
            if c.video_source != "decode_only":  # as after `python cache.py` or a previous eval
                load, _ = E.make_loader(processor, c, "nvr1")
                for s in E.load_benchmark("nvr1", c, []):
                    load(s)
            t = time.perf_counter()
            res = await E.evaluate(c, engine, processor)
            return res["nvr1"], time.perf_counter() - t
        finally:
            if c.engine == "async":  # the sync engine goes with its last reference
                engine.shutdown()

    # plain loop: one sample at a time, frames decoded each time (no cache), generate, wait; the pipeline: AsyncLLM
    base = replace(
        cfg,
        engine="sync",
        batch_size=1,
        video_source="decode_only",
        out_dir=os.path.join(work, "plain"),
    )
    plain, t_plain = asyncio.run(timed(base, "warm1"))
    pipe, t_pipe = asyncio.run(
        timed(replace(cfg, engine="async", out_dir=os.path.join(work, "async")), "warm2")
    )

    n = plain["metrics"]["n"]
    same = E.read_log(plain["samples"])[0] == E.read_log(pipe["samples"])[0]
    print(
        f"\n{n} samples, {width}x{height} px {fps:g} fps {seconds:g} s videos, greedy, "
        f"max_tokens {max_tokens}, identical per-sample results: {same}"
    )
    print(
        f"{'mode':<36}| {'seconds':>8} | {'samples/s':>9} | {'engine busy':>11} | {'in flight':>9} | frames"
    )
    print(
        f"{'plain loop (decode, generate, wait)':<36}| {t_plain:8.2f} | {n / t_plain:9.2f} | {'-':>11} | {1:9d} | "
        f"{plain['frames']}"
    )
    print(
        f"{'async pipeline (warm cache)':<36}| {t_pipe:8.2f} | {n / t_pipe:9.2f} | {pipe['engine_busy']:11.2f} | "
        f"{pipe['mean_in_flight']:9.1f} | {pipe['frames']}"
    )
    print(f"eval speedup: {t_plain / t_pipe:.2f}x")


if __name__ == "__main__":
    import tyro

    tyro.cli(main)

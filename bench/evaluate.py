"""The evaluate.py pipeline (AsyncLLM, warm frame cache, loader threads, many requests in flight) vs a plain loop
(decode, prompt, generate one sample, wait): same tiny model, videos and greedy settings, in one run (method and
clip sizes: docs/speed.md). The inputs each mode gives the engine (prompt ids, frames, pixel values) and the greedy
outputs are compared apart; each mode is timed `--repeats` times. Last line: `eval speedup: <median ratio>x` with its
spread; wall-clock is noisy on a shared machine, so the CPU-time ratio is printed too.

    OMP_NUM_THREADS=1 .venv/bin/python bench/evaluate.py [--samples 64 --width 640 --height 360 --fps 30 --seconds 30]
"""

import asyncio
import hashlib
import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass, replace

from harness import ROOT


def tree_cpu() -> float:
    """CPU seconds (user + sys) of this process and its children (the engine core) so far: the measure
    that a shared machine's load distorts least."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:  # a child gone between the listing and the reading
            pass
    return total


def input_digests(E, processor, c) -> dict:
    """sample id -> sha1 of what the engine is given for it under c's frame source: the prompt's
    token ids, the frames and their metadata, and the processor's pixel values."""
    load, _ = E.make_loader(processor, c, "nvr1")
    out = {}
    for s in E.load_benchmark("nvr1", c, []):
        p = load(s)
        h = hashlib.sha1(repr(p.prompt_ids).encode())
        for frames, meta in p.videos:
            h.update(frames.tobytes() + repr(sorted(meta.items())).encode())
        for k, v in sorted(p.mm.items()):
            h.update(
                k.encode() + (v.numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode())
            )
        out[s["id"]] = h.hexdigest()
    return out


def main(
    samples: int = 64,
    width: int = 640,
    height: int = 360,
    fps: float = 30.0,
    seconds: float = 30.0,
    max_tokens: int = 16,
    max_in_flight: int = 64,
    repeats: int = 3,
):
    """samples over three tasks, on width x height px videos at fps, seconds long (kept between runs);
    each mode timed `repeats` times on one engine."""
    import common

    common.quiet()  # vLLM's INFO lines; its shutdown's "force killing" warning below
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import make_synthetic_data
    import make_tiny_model
    import evaluate as E

    for h in logging.getLogger("vllm").handlers:
        h.addFilter(quiet_shutdown)
    work = os.path.join(ROOT, ".cache", "bench_eval")
    for sub in ("frames", "runs"):  # results and cache; the videos stay
        shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    d = os.path.join(work, "ann", "nvr1")
    t = time.perf_counter()
    make_synthetic_data.make(
        d,
        ["color", "count", "direction"],
        num_train=1,
        num_val=samples // 3 + 1,
        width=width,
        height=height,
        fps=fps,
        seconds=seconds,
    )
    print(f"videos ready ({time.perf_counter() - t:.0f} s)", flush=True)
    model = make_tiny_model.ensure("qwen2_5_vl")
    cfg = E.Config(
        model=model,
        benchmarks="nvr1",
        data_dir=os.path.join(work, "ann"),
        video_dir=work,
        max_samples=samples,
        max_tokens=max_tokens,
        max_model_len=2048,
        max_prompt_len=2048,
        video_max_frames=16,  # at 2 fps, 4 frames at least (the defaults)
        video_max_pixels=12544,
        cache_dir=os.path.join(work, "frames"),
        max_in_flight=max_in_flight,
    )
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    # plain loop: one sample at a time, frames decoded each time (no cache), generate, wait; the
    # pipeline: AsyncLLM on the warm cache, max_in_flight requests batched together
    plain_cfg = replace(cfg, engine="sync", batch_size=1, video_source="decode_only")
    pipe_cfg = replace(cfg, engine="async")

    async def timed(c: E.Config, label: str, *extra: E.Config) -> list[Run]:
        """c's runs: a 4-sample warm-up (with a cache: every video decoded once), then `repeats`
        timed runs on one engine, then one of each `extra` config on it."""
        engine = E.make_engine(c, processor.tokenizer)
        try:
            out = os.path.join(work, "runs", label)
            await E.evaluate(replace(c, max_samples=4, out_dir=f"{out}-warmup"), engine, processor)
            # as after `scripts/cache_frames.py` or a previous eval
            if c.video_source != "decode_only":
                input_digests(E, processor, c)
            runs = []
            for i, run in enumerate([c] * repeats + list(extra)):
                t = time.perf_counter()
                cpu = tree_cpu()
                res = await E.evaluate(replace(run, out_dir=f"{out}-{i}"), engine, processor)
                runs.append(Run(res["nvr1"], time.perf_counter() - t, tree_cpu() - cpu))
            return runs
        finally:
            if c.engine == "async":  # the sync engine goes with its last reference
                engine.shutdown()

    plain = asyncio.run(timed(plain_cfg, "plain"))
    # the control: the pipeline one request at a time (the plain loop's batch shape)
    *pipe, serial = asyncio.run(timed(pipe_cfg, "async", replace(pipe_cfg, max_in_flight=1)))

    def agree(a: dict, b: dict) -> int:
        return sum(a[k] == b.get(k) for k in a)

    # inputs and outputs compared apart: the same prompt ids and pixels, then the same greedy text
    inputs = input_digests(E, processor, plain_cfg)
    same_inputs = agree(inputs, input_digests(E, processor, pipe_cfg))
    texts = [{k: r["resps"][0] for k, r in E.read_log(x.result["samples"])[0].items()} for x in
             (plain[0], pipe[0], serial, *plain[1:], *pipe[1:])]  # fmt: skip
    n = plain[0].result["metrics"]["n"]

    print(
        f"\n{n} samples, {width}x{height} px {fps:g} fps {seconds:g} s videos, greedy, max_tokens "
        f"{max_tokens}\n"
        f"inputs (prompt ids, frames, pixel values; decoded vs cached frames) identical: "
        f"{same_inputs}/{len(inputs)}\n"
        f"outputs identical, plain loop vs pipeline ({max_in_flight} in flight): "
        f"{agree(texts[0], texts[1])}/{n}; vs the pipeline 1 in flight: {agree(texts[0], texts[2])}/{n};"
        f" across repeats: plain {all(t == texts[0] for t in texts[3 : 3 + repeats - 1])}, pipeline "
        f"{all(t == texts[1] for t in texts[3 + repeats - 1 :])}"
    )
    print(
        f"{'mode':<36}| {'seconds':>8} | {'CPU s':>7} | {'samples/s':>9} | {'in flight':>9} | frames"
    )
    for name, runs in (("plain loop (decode, generate, wait)", plain),
                       ("async pipeline (warm cache)", pipe)):  # fmt: skip
        for x in runs:
            r = x.result
            print(
                f"{name:<36}| {x.seconds:8.2f} | {x.cpu:7.1f} | {n / x.seconds:9.2f} | "
                f"{r.get('mean_in_flight', 1):9.1f} | {r['frames']}"
            )
    ratios = sorted(a.seconds / b.seconds for a, b in zip(plain, pipe))
    cpu = sorted(a.cpu / b.cpu for a, b in zip(plain, pipe))
    print(
        f"CPU-time ratio: median {statistics.median(cpu):.2f}x (min {cpu[0]:.2f}, max {cpu[-1]:.2f})"
        f"\neval speedup: {statistics.median(ratios):.2f}x (median of {repeats}; min "
        f"{ratios[0]:.2f}, max {ratios[-1]:.2f})"
    )


@dataclass
class Run:
    """One timed evaluation."""

    result: dict
    """evaluate()'s result for the benchmark"""
    seconds: float
    """wall-clock seconds"""
    cpu: float
    """CPU seconds of the process tree"""


def quiet_shutdown(record) -> bool:
    """vLLM's shutdown lines ("[shutdown] ... force killing remaining processes") stay out."""
    return "[shutdown]" not in record.getMessage()


if __name__ == "__main__":
    import tyro

    tyro.cli(main)

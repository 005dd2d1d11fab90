"""Per-step rollout time (generate + weight sync), issue 21's changes off and on: HF, one generate call for all
prompts vs one per prompt; vLLM sync, bucketed all-gathers vs one per tensor. Tiny Qwen2.5-VL, video and image, 1 and
2 ranks (docs/speed.md). Last line: generate + sync, 2 ranks, 8 x 8 video, HF engine.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rollout.py        # about 10 minutes on 2 cores
"""

import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

from harness import ROOT, launch, torchrun

SHAPES = [("video", 4), ("video", 8), ("image", 4), ("image", 8)]


def sync(ckpt, engine, model, bucketed: bool):
    """engine.sync (HF: nothing to sync, it samples from the training model), or the same with each DTensor
    all-gathered alone (full_tensors' bucket_bytes 1): issue 21's baseline."""
    if bucketed:
        engine.sync(model)
        return
    alone = functools.partial(ckpt.full_tensors, bucket_bytes=1)
    with mock.patch.object(ckpt, "full_tensors", alone):
        engine.sync(model)


def worker(engine_kind: str, model_dir: str, data_path: str, out: str):
    import torch.distributed as dist
    from transformers import AutoProcessor

    import ckpt
    import data
    import rollout
    import train

    train.common.quiet()  # the start-up and per-step library lines train.py's own runs drop
    rank, world, device = train.init_dist()
    cfg = train.load_config(
        ["--config", os.path.join(ROOT, "configs/tiny_cpu.yaml"), "--model", model_dir]
    )
    processor = AutoProcessor.from_pretrained(model_dir)
    model = train.load_model(cfg, device)
    if engine_kind == "vllm":
        engine = rollout.VLLMEngine(
            model_dir, processor.tokenizer, max_model_len=1024, dtype="float32"
        )
    else:
        dummies = data.dummy_prompts(processor) if world > 1 else None
        engine = rollout.HFEngine(model, processor.tokenizer, rollout.eos_token_ids(model), dummies)
    rows = []
    samples = data.load_samples(data_path)
    for task, n_prompts in SHAPES:
        k = n_prompts // world
        prompts = [
            data.prepare(s, processor, cfg)
            for s in [s for s in samples if s.get(task + "s")][rank * k :][:k]
        ]
        times = {"off": [], "on": []}  # switch off / on: (generate s, sync s) per step
        for step in range(4):
            for key, on in (("off", False), ("on", True)):  # interleaved: both see the same load
                seed = rollout.request_seed(0, step, 0)
                t0 = time.perf_counter()
                if on or engine_kind == "vllm":  # vLLM always took a call's prompts in one batch
                    engine.generate(prompts, 8, 1.0, 8, seed)
                else:
                    for p in prompts:
                        engine.generate([p], 8, 1.0, 8, seed)
                dist.barrier()  # the slowest rank's generate counts
                t1 = time.perf_counter()
                sync(ckpt, engine, model, bucketed=on)
                dist.barrier()
                times[key].append((t1 - t0, time.perf_counter() - t1))
        row = dict(task=task, prompts=n_prompts, tokens=len(prompts[0].prompt_ids))
        # the median (generate s, sync s) of each switch: step 0 warms up
        rows.append(
            row | {k: [statistics.median(x) for x in zip(*t[1:])] for k, t in times.items()}
        )
    if rank == 0:
        json.dump(rows, open(out, "w"))


def main():
    import make_synthetic_data
    import make_tiny_model

    t0 = time.time()
    model = make_tiny_model.ensure("qwen2_5_vl")
    data_dir = make_synthetic_data.make(
        os.path.join(ROOT, ".cache/data/bench_rollout"),
        ["color", "image_color"],
        num_train=8,
        num_val=0,
    )  # 56x56, 4 fps, 2 s
    tmp = tempfile.mkdtemp()
    env = dict(
        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", VLLM_ENABLE_V1_MULTIPROCESSING="0"
    )
    res = {}
    for engine, ranks in itertools.product(("hf", "vllm"), (1, 2)):
        out = os.path.join(tmp, f"{engine}_{ranks}.json")
        cmd = torchrun(ranks, __file__, "--worker", engine, model, data_dir["train"], out)
        launch(cmd, f"{engine} {ranks} ranks", **env)
        res[engine, ranks] = json.load(open(out))
    print(
        "\nswitch off: hf one generate per prompt, vllm one all-gather per tensor; on: today's engines\n"
        "| engine | ranks | task | prompts x 8 | prompt tokens | gen off | gen on | sync off | sync on "
        "| step speedup |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for (engine, ranks), shapes in res.items():
        for r in shapes:
            off, on = r["off"], r["on"]  # (generate s, sync s) each
            print(
                f"| {engine} | {ranks} | {r['task']} | {r['prompts']} | {r['tokens']} "
                f"| {1000 * off[0]:.0f} ms | {1000 * on[0]:.0f} ms | {1000 * off[1]:.0f} ms "
                f"| {1000 * on[1]:.0f} ms | {sum(off) / sum(on):.2f}x |"
            )
    print(f"\nbench total {time.time() - t0:.0f}s; a shared 2-core CPU: timings are noisy")
    r = res["hf", 2][SHAPES.index(("video", 8))]
    print(f"rollout step speedup: {sum(r['off']) / sum(r['on']):.2f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:])
    elif sys.argv[1:]:  # --help (or a typo): say what it runs instead of starting a 10-minute bench
        print(__doc__)
    else:
        main()

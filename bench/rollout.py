"""Per-step rollout time (generate + weight sync), rollout.py before issue 21 ("before": `git show BEFORE:rollout.py`)
vs this checkout's ("after"): the tiny Qwen2.5-VL, video and image prompts, HF and vLLM engines, 1 and 2 ranks (the
setup: docs/speed.md). Last line: generate + sync, 2 ranks, 8 x 8 video, HF engine.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rollout.py        # about 10 minutes on 2 cores
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
BEFORE = "2737071"  # main before issue 21 was merged: its rollout.py is the baseline ("main" holds the new one now)
SHAPES = [("video", 4), ("video", 8), ("image", 4), ("image", 8)]  # image 8 x 8 last: the old vLLM engine crashes on it


def worker(version: str, engine_kind: str, model_dir: str, data_path: str, rollout_dir: str, out: str):
    import importlib.util

    import torch
    import torch.distributed as dist
    from transformers import AutoProcessor

    import data
    import train  # imports this checkout's rollout.py (ckpt.py needs it); the one under test is loaded beside it
    spec = importlib.util.spec_from_file_location(f"rollout_{version}", os.path.join(rollout_dir, "rollout.py"))
    rollout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rollout)
    rank, world, device = train.init_dist()
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs/tiny_cpu.yaml"), "--model", model_dir])
    processor = AutoProcessor.from_pretrained(model_dir)
    model = train.load_model(cfg, device)
    eos, dummies = model.generation_config.eos_token_id, data.dummy_prompts(processor) if world > 1 else None
    if engine_kind == "vllm":
        engine = rollout.VLLMEngine(model_dir, processor.tokenizer, max_model_len=1024, dtype="float32")
    else:
        engine = rollout.HFEngine(model, processor.tokenizer, eos, *[0] * (version == "before"), dummies)
    rows, samples = [], data.load_samples(data_path)
    for task, n_prompts in SHAPES:
        k = n_prompts // world
        prompts = [data.prepare(s, processor, cfg) for s in [s for s in samples if s.get(task + "s")][rank * k:][:k]]
        times = []
        for step in range(4):
            ok, t0 = torch.ones(1), time.perf_counter()
            try:
                engine.step = step  # the baseline's engines read it; this checkout's take the call's seed
                engine.generate(prompts, 8, 1.0, 8, *[rollout.request_seed(0, step, 0)] * (version == "after"))
            except RuntimeError as e:  # the baseline's vLLM engine at 8 image prompts x 8 ("does not use offset")
                print(f"rank {rank} {task} x {n_prompts}: {str(e)[-100:]}", flush=True)
                ok.zero_()
            dist.all_reduce(ok, dist.ReduceOp.MIN)  # the barrier too: the slowest rank's generate counts
            if not ok.item():
                break
            t1 = time.perf_counter()
            engine.sync(model)
            dist.barrier()
            times.append((t1 - t0, time.perf_counter() - t1))
        med = [statistics.median(x) for x in zip(*times[1:])] if len(times) == 4 else None  # step 0 warms up
        rows.append(dict(task=task, prompts=n_prompts, tokens=len(prompts[0].prompt_ids), med=med))
        if med is None:
            break  # the engine's state after the exception is unknown
    if rank == 0:
        json.dump(rows, open(out, "w"))


def main():
    import make_synthetic_data
    import make_tiny_model
    t0 = time.time()
    model = make_tiny_model.ensure("qwen2_5_vl", root=os.path.join(ROOT, ".cache/models"))
    data_dir = make_synthetic_data.make(os.path.join(ROOT, ".cache/data/bench_rollout"), ["color", "image_color"],
                                        num_train=8, num_val=0, seed=0, size=56, fps=4, seconds=2.0)
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "rollout.py"), "w") as f:
        f.write(subprocess.run(["git", "show", f"{BEFORE}:rollout.py"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    res = {}
    for engine, ranks, version in [(e, r, v) for e in ("hf", "vllm") for r in (1, 2) for v in ("before", "after")]:
        out = os.path.join(tmp, f"{version}_{engine}_{ranks}.json")
        code = tmp if version == "before" else ROOT
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                            __file__, "--worker", version, engine, model, data_dir["train"], code, out], cwd=ROOT,
                           env=env, capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"{version} {engine} {ranks} ranks failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
        res[version, engine, ranks] = json.load(open(out))
    print("\n| engine | ranks | task | prompts x 8 | prompt tokens | gen before | gen after | sync before | sync after "
          "| step speedup |\n|" + "---|" * 10)
    for engine, ranks in [(e, r) for e in ("hf", "vllm") for r in (1, 2)]:
        for b, a in zip(res["before", engine, ranks], res["after", engine, ranks]):
            before = [f"{1000 * x:.0f} ms" for x in b["med"]] if b["med"] else ["crash", "crash"]
            (gen_b, gen_a), (sync_b, sync_a) = zip(before, [f"{1000 * x:.0f} ms" for x in a["med"]])
            speedup = f"{sum(b['med']) / sum(a['med']):.2f}x" if b["med"] else "before crashed"
            print(f"| {engine} | {ranks} | {b['task']} | {b['prompts']} | {b['tokens']} | {gen_b} | {gen_a} | {sync_b} "
                  f"| {sync_a} | {speedup} |")
    print(f"\nbench total {time.time() - t0:.0f}s; a shared 2-core CPU: timings are noisy")
    b, a = (res[v, "hf", 2][SHAPES.index(("video", 8))]["med"] for v in ("before", "after"))
    print(f"rollout step speedup: {sum(b) / sum(a):.2f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:])
    else:
        main()

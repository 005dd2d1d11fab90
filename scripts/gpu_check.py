"""One GPU, under 10 minutes (docs/gpu-check.md): planner vs measured peak at real width (random init, a few layers),
train-phase MFU, bf16 sampler vs trainer log-probs, offload, tests/test_gpu.py.

    python scripts/gpu_check.py --out-dir runs/gpu_check          # one CUDA GPU (make gpu-check)
    .venv/bin/python scripts/gpu_check.py --cpu-smoke              # the same code on the tiny models, on CPU
"""

import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
import common  # noqa: E402  (the project root is put on sys.path above)
import data  # noqa: E402
import memory_plan  # noqa: E402
import sp  # noqa: E402
import train  # noqa: E402
from rollout import HFEngine, Rollout, eos_token_ids, vision_token_ids  # noqa: E402

GIB = 2**30
TOLERANCE = 0.15
DEADLINE_S = 420  # no model starts that would end later, by the last one's time
RECIPES = {
    "Qwen/Qwen2.5-VL-7B-Instruct": "configs/qwen2_5_vl_7b.yaml",
    "Qwen/Qwen3-VL-8B-Instruct": "configs/qwen3_vl_8b.yaml",
}
SMOKE = dict(
    video_max_frames=4, video_max_pixels=4 * 3136, max_response_len=16, micro_batch_size=2
)  # + tiny_cpu
SETTINGS = {
    "ckpt off": dict(gradient_checkpointing=False),
    "ckpt on": dict(gradient_checkpointing=True),
    "ckpt on + offload": dict(gradient_checkpointing=True, offload=True),
}
FIGURES = ("ratio", "logp_s", "update_s", "tokens_per_s")  # the table's columns after the peaks
# dense bf16, by a part of the device's name (the first that matches)
PEAK_TFLOPS = {"H100 PCIe": 756, "H100": 989, "H200": 989, "A100": 312, "B200": 2250}


@dataclass
class Config:
    models: tuple[str, ...] = tuple(RECIPES)
    """published models with a recipe in RECIPES, in order (the second starts if the first's time fits DEADLINE_S)"""
    layers: int = 2
    """decoder layers kept, at full width"""
    blocks: int = 4
    """vision blocks kept, at full width (Qwen2.5-VL: the last attends fully; Qwen3-VL: the first feeds deepstack)"""
    rows: int = 0
    """rows per micro-batch (0 = the recipe's: as many as max_tokens_per_micro_batch holds)"""
    peak_tflops: float = 0.0
    """the GPU's dense bf16 TFLOP/s for MFU (0 = by its name, PEAK_TFLOPS; unknown: no MFU)"""
    out_dir: str = "runs/gpu_check"
    """gpu_check.json (every figure, rewritten after each row) and gpu_check.md (the table)"""
    cpu_smoke: bool = False
    """the two tiny models (scripts/make_tiny_model.py), 4 frames, 16 tokens, on CPU (or the GPU there is): seconds"""


def cut(spec: dict, layers: int, blocks: int) -> dict:
    """The published config with `layers` decoder layers and `blocks` vision blocks (then one block of each kind)."""
    text = dict(spec["text_config"])
    vision = dict(spec["vision_config"])
    text["num_hidden_layers"] = min(layers, text["num_hidden_layers"])
    if blocks < vision["depth"]:
        if "deepstack_visual_indexes" in vision:  # Qwen3-VL; Qwen2.5-VL has full-attention blocks
            vision["deepstack_visual_indexes"] = [0]
        else:
            vision["fullatt_block_indexes"] = [blocks - 1]
        vision["depth"] = blocks
    return dict(spec, text_config=text, vision_config=vision)


def numel(module) -> int:
    """The parameters of `module` (a model, a layer, a tower)."""
    return sum(p.numel() for p in module.parameters())


def build(spec: dict, tiny: str, folder: str, device) -> dict:
    """A random-init bf16 checkpoint of `spec` in `folder`, with the token ids of `tiny` (whose processor we use).
    Returns the planner's parameter counts."""
    import transformers

    ref = transformers.AutoConfig.from_pretrained(tiny)
    text = dict(
        spec["text_config"],
        bos_token_id=None,
        eos_token_id=ref.text_config.eos_token_id,
        pad_token_id=ref.text_config.pad_token_id,
    )
    text.pop("layer_types", None)  # derived from the depth
    ids = {
        k: getattr(ref, k)
        for k in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        )
    }
    config = type(ref)(
        text_config=text,
        vision_config=spec["vision_config"],
        tie_word_embeddings=text["tie_word_embeddings"],
        **ids,
    )
    with device:  # initialized where it will train (fast), in bf16: the checkpoint's dtype on disk
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config = transformers.GenerationConfig.from_pretrained(tiny)
    model.save_pretrained(folder)
    sizes = [numel(b) for b in [*model.model.language_model.layers, *model.model.visual.blocks]]
    total = numel(model)
    return dict(
        total=total,
        largest_layer=max(sizes),
        root=total - sum(sizes),
        vision=numel(model.model.visual),
    )


def video_prompt(cfg, processor) -> data.Prompt:
    """A question on video_max_frames random 720p frames, sized as cache.py and expanded as data.prepare does."""
    q = memory_plan.question(cfg, processor, *memory_plan.SOURCE_HW)
    frames = torch.randint(
        0,
        256,
        (q.frames, q.height, q.width, 3),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(0),
    )
    ids, mm = data.run_processor(
        processor, q.text, videos=[frames.movedim(-1, -3)], video_metadata=[q.meta]
    )
    data.check_placeholders(ids, mm, processor, q.sample["id"])
    return data.Prompt(q.sample, q.text, ids, mm, [(frames.numpy(), q.meta)])


def clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def train_step(t: train.Trainer, rollouts: list, cfg, tok) -> dict:
    """train.main's train phase, timed: a no-grad log-prob pass over the first micro-batch (what an off-policy
    update adds), then train.train_phase with rewards +-1 by row (group_size 1: advantages about +-1)."""
    t0 = clock(t.device)
    first = train.micro_batches(rollouts, cfg, tok, t.device, t.dummies)[0][0]
    with torch.no_grad():
        train.token_logp(t.model, first, cfg.temperature, t.banned, cfg.logp_chunk, t.layout)
    del first
    t1 = clock(t.device)
    rows = dict(
        reward=[i % 2 * 2.0 - 1 for i in range(len(rollouts))],
        length=[len(r.response_ids) for r in rollouts],
        baseline=[0.0] * len(rollouts),
    )
    ids = [r.prompt.sample["id"] for r in rollouts]
    train.train_phase(t, rollouts, rows, 0, replace(cfg, group_size=1), tok, step=1, ids=ids)
    return dict(logp_s=t1 - t0, update_s=clock(t.device) - t1)


def update_flops(model, prompt: data.Prompt, rows: int, response: int) -> float:
    """Model FLOPs of the update, 3 x its forward (no recompute): 2 per weight and token (patch, merged token, logit
    position), plus attention: causal over each row, the tower's within a frame pair or a window."""
    text = model.config.text_config
    vision = model.config.vision_config
    tower = model.model.visual
    tokens = len(prompt.prompt_ids) + response
    pairs, h, w = prompt.mm["video_grid_thw"][0].tolist()
    frame = h * w  # patches of a frame pair
    patches = pairs * frame
    layers = model.model.language_model.layers
    dec = numel(layers)
    blk = numel(tower.blocks)
    embed = numel(tower.patch_embed)
    rest = numel(tower)
    dense = (
        rows * tokens * dec
        + patches * (blk + embed)
        + patches / 4 * (rest - blk - embed)
        + rows * response * text.vocab_size * text.hidden_size
    )
    heads = text.num_attention_heads * getattr(
        text, "head_dim", text.hidden_size // text.num_attention_heads
    )
    full = getattr(vision, "fullatt_block_indexes", range(vision.depth))  # Qwen3-VL: every block
    window = (
        getattr(vision, "window_size", 0) // vision.patch_size
    ) ** 2  # Qwen2.5-VL's other blocks
    attention = rows * tokens**2 * heads * len(layers) + sum(
        2 * patches * (frame if i in full else window) * vision.hidden_size
        for i in range(vision.depth)
    )
    return 6 * (dense + attention)


def numerics(t: train.Trainer, prompt: data.Prompt, cfg, tok, tokens: int) -> dict:
    """train.py's mismatch metrics: rollout hf's log-probs against the trainer's on the tokens it sampled."""
    engine = HFEngine(t.model, tok, eos_token_ids(t.model))
    rollouts = engine.generate([prompt], 2, cfg.temperature, tokens, seed=cfg.seed)
    [[b]] = train.micro_batches(
        rollouts, replace(cfg, micro_batch_size=2), tok, t.device, t.dummies
    )
    b.adv = torch.zeros_like(b.mask)
    with torch.no_grad():
        m = train.micro_loss(t.model, b, cfg, t.banned)[1]
    return {
        "mismatch/mean": m["mismatch_sum"] / max(1.0, m["mismatch_n"]),
        "mismatch/max": m["mismatch_max"],
        "tokens": int(m["mismatch_n"]),
    }


def run_model(name: str, c: Config, device, report: dict, folder: str):
    """One model's rows: per setting, train.build_trainer and two steps, the second measured; numerics once."""
    import make_tiny_model
    from transformers import AutoProcessor, PreTrainedModel

    cuda = device.type == "cuda"
    try:
        spec, meas = memory_plan.stored(name, "bfloat16" if cuda else "float32")
    except KeyError:  # the smoke's tiny Qwen3-VL has no fp32 measurements: no prediction
        spec = json.load(open(os.path.join(name, "config.json")))
        meas = None
    spec = cut(spec, c.layers, c.blocks)
    tiny = make_tiny_model.ensure(spec["model_type"])
    counts = build(spec, tiny, folder, device)
    recipe = common.yaml_overlay(
        train.Config(), os.path.join(ROOT, RECIPES.get(name, "configs/tiny_cpu.yaml"))
    )
    cfg = replace(recipe, model=folder, cache_dir="", **(SMOKE if c.cpu_smoke else {}))
    processor = AutoProcessor.from_pretrained(tiny)
    tok = processor.tokenizer
    R = cfg.max_response_len
    prompt = video_prompt(cfg, processor)
    tokens, patches = memory_plan.longest_prompt(replace(cfg, model=tiny), *memory_plan.SOURCE_HW)
    assert (tokens, patches) == (
        len(prompt.prompt_ids),
        prompt.mm["video_grid_thw"].prod().item(),
    ), "planner's"
    # as main splits the batch: rows, or as many as the token budget holds
    rows = c.rows or cfg.micro_batch_size
    if cfg.max_tokens_per_micro_batch and not c.rows:
        rows = max(1, cfg.max_tokens_per_micro_batch // (tokens + R))
    cfg = replace(cfg, micro_batch_size=rows, max_tokens_per_micro_batch=0)
    responses = torch.randint(  # any ids above the (banned) vision tokens
        max(vision_token_ids(tok)) + 1,
        spec["text_config"]["vocab_size"],
        (rows, R),
        generator=torch.Generator().manual_seed(0),
    )
    rollouts = [Rollout(prompt, ids, None, "", "length") for ids in responses.tolist()]
    shape = dict(
        model=name,
        layers=spec["text_config"]["num_hidden_layers"],
        blocks=spec["vision_config"]["depth"],
        rows=rows,
        prompt=tokens,
        response=R,
        patches=patches,
    )
    for setting, switches in SETTINGS.items():
        gc.collect()  # the last setting's (or build's) model: FSDP's hooks hold reference cycles
        torch.cuda.empty_cache()  # a no-op without CUDA
        scfg = replace(cfg, **switches)
        t = None
        row = dict(
            shape,
            setting=setting,
            predicted=None,
            measured=None,
            leftover=sum(isinstance(o, PreTrainedModel) for o in gc.get_objects()),
        )  # > 0: a model leaked
        if meas:
            gpu_mem = torch.cuda.get_device_properties(device).total_memory if cuda else 0
            p = memory_plan.plan(
                scfg, spec, dict(meas, params=counts), 1, gpu_mem, cuda, tokens, patches
            )
            row.update(predicted=p.train, plan=p.held | p.transient)
        try:
            t = train.build_trainer(scfg, processor, sp.make_layout(1), device)  # model, AdamW
            train_step(t, rollouts, scfg, tok)  # AdamW's state exists from here on
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            row.update(train_step(t, rollouts, scfg, tok))
            if cuda:
                row["measured"] = torch.cuda.max_memory_allocated(device)
            row.update(
                flops=update_flops(t.model, prompt, rows, R),
                tokens_per_s=rows * (tokens + R) / row["update_s"],
            )
            if setting == "ckpt on":
                row["numerics"] = numerics(t, prompt, scfg, tok, min(256, R))
        except Exception as e:  # noqa: BLE001  OOM or a bug: the row names it, the other rows still run
            row.update(measured=type(e).__name__, error=traceback.format_exc()[-3000:])
            print(row["error"], file=sys.stderr)
        del t
        report["rows"].append(row)
        shown = {k: row.get(k) for k in ("predicted", "measured", "logp_s", "update_s", "numerics")}
        print(
            f"{time.strftime('%X')} {os.path.basename(name)} | {setting}: {json.dumps(shown)}",
            flush=True,
        )
        write(report, c)


def gib(x) -> str:
    """Bytes in GiB; an exception's name as it is; None as -."""
    return f"{x / GIB:.3g} GiB" if isinstance(x, (int, float)) else str(x or "-")


def table(report: dict) -> list[str]:
    """The table; the best MFU, numerics and tests lines; the last: how many peaks are within TOLERANCE."""
    lines = [
        "| model | setting | predicted peak | measured peak | measured / predicted | logp pass s | update s | "
        "tokens/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    within = []
    peak = report["peak_tflops"]
    for r in report["rows"]:
        if r["predicted"] and r["measured"] is not None:  # measured: bytes, or the exception's name
            r["ratio"] = r["measured"] / r["predicted"] if isinstance(r["measured"], int) else None
            within.append(r["ratio"] is not None and abs(r["ratio"] - 1) <= TOLERANCE)
        if peak and "flops" in r:
            r["mfu"] = r["flops"] / (r["update_s"] * peak * 1e12)
        figures = [f"{r[k]:.3g}" if r.get(k) is not None else "-" for k in FIGURES]
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        lines.append(
            f"| {os.path.basename(r['model'])} | {r['setting']} | {gib(r['predicted'])} | "
            f"{gib(r['measured'])} | {' | '.join(figures)} | {mfu} |"
        )
    with_mfu = [r for r in report["rows"] if "mfu" in r]
    if with_mfu:
        best = max(with_mfu, key=lambda r: r["mfu"])
        lines.append(
            f"best MFU: {best['mfu']:.1%}, {os.path.basename(best['model'])} {best['setting']} "
            f"(of {peak:g} bf16 TFLOP/s)"
        )
    for r in (r for r in report["rows"] if "numerics" in r):
        n = r["numerics"]
        lines.append(
            f"bf16 numerics, {os.path.basename(r['model'])}: rollout hf vs trainer on {n['tokens']} tokens: "
            f"mismatch/mean {n['mismatch/mean']:.3g}, mismatch/max {n['mismatch/max']:.3g}"
        )
    lines += [f"not run (deadline): {name}" for name in report["skipped"]]
    lines.append(f"tests/test_gpu.py: {report['tests']['summary']}")
    return lines + [f"gpu check: {sum(within)} of {len(within)} within {TOLERANCE:.0%}"]


def write(report: dict, c: Config):
    common.write_text(
        os.path.join(c.out_dir, "gpu_check.json"), json.dumps(report, indent=1, default=str)
    )


def main(c: Config) -> list[str]:
    """Every model that fits the deadline, then tests/test_gpu.py; prints the table and writes the files."""
    import make_tiny_model
    import transformers

    with socket.socket() as s:  # a free port for the world of one
        s.bind(("127.0.0.1", 0))
        world = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_PORT=str(s.getsockname()[1]))
    for k, v in dict(world, MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    device = common.init_dist(offload=True)[
        2
    ]  # offload's backends: gloo beside nccl, for the CPU shards
    if device.type != "cuda" and not c.cpu_smoke:
        sys.exit("gpu_check: no CUDA device (--cpu-smoke runs the tiny models on CPU)")
    models = c.models
    if c.cpu_smoke:
        models = [make_tiny_model.ensure(a) for a in ("qwen2_5_vl", "qwen3_vl")]
    report = dict(
        device=str(device),
        torch=torch.__version__,
        transformers=transformers.__version__,
        config=asdict(c),
        peak_tflops=c.peak_tflops,
        rows=[],
        skipped=[],
    )
    if device.type == "cuda":
        report["device"] = torch.cuda.get_device_name(device)
        report["peak_tflops"] = c.peak_tflops or next(
            (t for k, t in PEAK_TFLOPS.items() if k in report["device"]), 0
        )
    start = time.time()
    last = 0.0  # the last model's time
    # the checkpoint at hand
    with tempfile.TemporaryDirectory(prefix="gpu_check-", ignore_cleanup_errors=True) as folder:
        for name in models:
            if time.time() - start + last > DEADLINE_S:
                report["skipped"].append(name)
                continue
            t0 = time.time()
            try:
                run_model(name, c, device, report, folder)
            except Exception:  # noqa: BLE001  before its settings (build, prompt): a row says so, the next model runs
                report["rows"].append(
                    dict(
                        model=name,
                        setting="-",
                        predicted=None,
                        measured="error",
                        error=traceback.format_exc()[-3000:],
                    )
                )
                print(report["rows"][-1]["error"], file=sys.stderr)
            last = time.time() - t0
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "tests/test_gpu.py",
    ]
    gc.collect()  # the last model, before the tests take the GPU
    torch.cuda.empty_cache()
    env = {k: v for k, v in os.environ.items() if k not in world}  # a fresh process, not our world
    try:  # for what is left of 570 s (at least a minute); on CPU the tests skip
        p = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
            timeout=max(60, 570 + start - time.time()),
        )
        report["tests"] = dict(
            summary=(p.stdout.strip() or "no output").splitlines()[-1], output=p.stdout[-4000:]
        )
    except subprocess.TimeoutExpired:
        report["tests"] = dict(summary="timed out")
    lines = table(report)
    write(dict(report, summary=lines[-1]), c)
    common.write_text(os.path.join(c.out_dir, "gpu_check.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    torch.distributed.destroy_process_group()
    return lines


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))

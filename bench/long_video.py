"""Long videos (issues 14, 27, 40): per-rank peak memory and step time of the train phase, sp1
against sp2 at 3,600 frames, and MR-SP against the trainer before vision-once; the vision encodes
per prompt and step; --plan-check: a real train.py run's train phase against the planner.

    .venv/bin/python bench/long_video.py        # about 15 minutes on 2 idle cores
    .venv/bin/python bench/long_video.py --encodes        # the encode count alone
    VLLM_CPU_KVCACHE_SPACE=1 torchrun --nproc_per_node=2 \
        bench/long_video.py --plan-check configs/long_video_cpu.yaml configs/long_video_3600_cpu.yaml

memory.py's worker, a fresh process per row: clips of F frames at 112 x 112 (16 tokens per frame
pair: 28,9xx-token prompts at 3,600 frames), kl_coef 0.01 (a step is the reference pass and the
update). Rows, and what each ratio holds:
- sp1, sp2: 3,600 frames, one clip, memory.py's "all on" (features once, checkpointing, one row
  per micro-batch), on 1 and 2 ranks; group_size 2 (a row per micro-batch: the peak does not grow
  with it). `per-rank memory sp1/sp2`.
- each row encoded, vision-once dp 2, MR-SP sp 2: SPEED_FRAMES, 2 clips on 2 ranks, group_size 8,
  no checkpointing. "each row encoded" is the trainer before vision-once (today's code, every
  row's video encoded in every pass, the tower trained); "vision-once dp 2" encodes each clip once
  per step on its own rank (freeze_vision, data-parallel); "MR-SP sp 2" is the same with sp_size
  2. `long video step speedup` = each row encoded / MR-SP, the product of encoding once (each row
  encoded / vision-once) and `of which sequence parallel` (vision-once / MR-SP). At 3,600 frames
  "each row encoded" holds 8 rows' vision activations per rank (~10 GB), more than this machine
  lends.
- the encode count: 2 clips of COUNT_FRAMES frames in one process, the hour recipes'
  micro-batching (one row per micro-batch, group_size rows per prompt), 2 mini-batches, kl_coef,
  gradient_checkpointing, 2 train phases on the same samples; the trained tower and
  freeze_vision. The last line counts the trainer's passes over a prompt in step 1 (the
  reference's first sight of the samples included); vLLM's own encode for generation comes on
  top.
Memory: the resident-set rise over the step, less the file-backed pages it faulted in
(memory.mark, memory.rise), the largest rank's. Details: docs/speed.md.
"""

import json
import os
import sys
from dataclasses import replace

import memory  # its harness puts the repository first on sys.path
import torch

TOP = 3600  # frames of the memory pair: Long-RL's hour at 1 fps
SPEED_FRAMES = 512  # the speed rows' clips
COUNT_FRAMES = 32  # the encode count's clips (the count does not depend on the length)


def run_phases(paths: list[str]):
    """train.main on the configs `paths` (under torchrun) with each step's train phase (from
    train.micro_batches to the weight sync: log-prob passes, advantages, update) measured as
    memory.worker does; each rank prints its peaks, rank 0 its largest after step 1 against the
    planner's CPU prediction for the run's own prompts (less the weights and AdamW states, resident
    before the phase)."""
    import data
    import memory_plan
    import rollout
    import train
    from transformers import AutoProcessor

    micro_batches = train.micro_batches
    sync = rollout.VLLMEngine.sync
    sample_batch = train.sample_batch
    bases = []
    peaks = []  # each train phase's memory.mark(), and its peak rise
    rises = []  # each step's generation phase (prepare, frames shared, vLLM, SP runs): RSS rise

    def start(*args, **kw):  # the train phase's first call
        bases.append(memory.mark())
        return micro_batches(*args, **kw)

    def end(
        *args, **kw
    ):  # the weight sync after the update (train.main syncs once before step 1 too)
        if len(bases) > len(peaks):
            peaks.append(memory.rise(bases[-1]))
        return sync(*args, **kw)

    def generation(*args, **kw):
        base = memory.mark()
        batch = sample_batch(*args, **kw)
        rises.append(memory.rise(base))
        return batch

    train.micro_batches, rollout.VLLMEngine.sync = start, end
    train.sample_batch = generation
    cfg = train.load_config(["--config", *paths])
    train.common.quiet()  # the start-up and per-step library lines train.py's own runs drop
    train.main(cfg)
    peak = max(peaks[1:] or peaks)
    rank = int(os.environ.get("RANK", 0))
    print(
        json.dumps(
            {
                "rank": rank,
                "peaks_mib": [round(p / 2**20, 1) for p in peaks],
                "generation_rise_mib": [round(r / 2**20, 1) for r in rises],
            }
        )
    )
    if rank == 0:
        processor = AutoProcessor.from_pretrained(cfg.model)
        prompt = data.prepare(data.load_samples(cfg.train_data)[0], processor, cfg)
        spec, meas = memory_plan.stored(cfg.model, "float32")
        p = memory_plan.plan(
            cfg,
            spec,
            meas,
            int(os.environ["WORLD_SIZE"]),
            24 * 2**30,
            False,
            len(prompt.prompt_ids),
            int(prompt.mm["video_grid_thw"].prod()),
            cfg.sp_size,
        )
        planned = p.train - sum(
            v for k, v in p.held.items() if k.startswith(("parameters", "optimizer"))
        )
        print(
            f"{len(prompt.prompt_ids)}-token prompts, sp_size {cfg.sp_size}: rank 0's train phase "
            f"{peak / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB: {peak / planned:.2f}x"
        )
        host = sum(v for k, v in p.host.items() if k.startswith(("frames", "pixels", "SP runs")))
        rise = max(rises[1:] or rises)
        print(
            f"rank 0's generation phase: RSS rise {rise / 2**20:.1f} MiB, the planner's host line "
            f"(frames, pixels, SP runs) {host / 2**20:.1f} MiB: {rise / host:.2f}x"
        )


def encode_counts(c: memory.Config, **switches) -> list[dict]:
    """Vision encodes per prompt in each of 2 train phases (memory.train_phase) of the
    hour recipes' micro-batching in one process: one row per micro-batch, group_size rows per
    prompt, 2 mini-batches, kl_coef, gradient_checkpointing; the same samples both steps (the
    reference's features kept from step 1). Per step: {"policy": the policy tower's passes over a
    prompt, "reference": the reference's, "recomputed": the tower passes checkpointing recomputes
    in backward (block calls / depth less tower calls)}."""
    import sp
    import train
    from transformers import AutoProcessor

    c = replace(c, frames=COUNT_FRAMES, prompts=2)
    memory.prepare(c)
    settings = dict(micro_batch_size=1, mini_batches=2, gradient_checkpointing=True, **switches)
    cfg = replace(memory.train_config(c), **settings)
    processor = AutoProcessor.from_pretrained(cfg.model)
    t = train.build_trainer(cfg, processor, sp.make_layout(1), torch.device("cpu"))
    rollouts = memory.rollouts(c, memory.prompts(c, processor, cfg))
    videos = {"policy": [], "reference": []}  # videos per tower call
    blocks = []
    for name, m in (("policy", t.model), ("reference", t.ref)):
        if m is not None:
            memory.count_videos(m.model.visual, videos[name])
            for block in m.model.visual.blocks:
                block.register_forward_pre_hook(lambda *_: blocks.append(1))
    depth = len(t.model.model.visual.blocks)
    counts = []
    for _ in range(2):
        for v in videos.values():
            v.clear()
        blocks.clear()
        memory.train_phase(t, rollouts, cfg, processor.tokenizer)
        calls = sum(len(v) for v in videos.values())
        per_prompt = {name: sum(v) / c.prompts for name, v in videos.items()}
        counts.append(per_prompt | {"recomputed": len(blocks) / depth - calls})
    return counts


def main(c: memory.Config):
    print(
        f"clips of F frames {c.size}x{c.size}, {c.response_len} response tokens, kl_coef {c.kl_coef}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings are noisy)"
    )
    print(
        "| frames | tokens per sequence | setting | group_size | clips | ranks | peak memory per rank | step time | "
        "vision encodes (rank 0) |\n|---|---|---|---|---|---|---|---|---|"
    )
    one = replace(c, frames=TOP, prompts=1, group_size=2)
    timed = replace(
        c, frames=SPEED_FRAMES, prompts=2, ranks=2, steps=c.steps + 2
    )  # 3 timed steps: the fastest
    runs = {
        "sp1": ("all on", replace(one, ranks=1, sp_size=1)),
        "sp2": ("all on", replace(one, ranks=2, sp_size=2)),
        "each row encoded": (memory.PER_ROW, timed),
        "vision-once dp 2": ("freeze_vision", timed),
        "MR-SP sp 2": ("freeze_vision", replace(timed, sp_size=2)),
    }
    rows = {}
    for name, (setting, cf) in runs.items():
        memory.prepare(cf)
        rows[name] = r = memory.run(cf, setting)
        print(
            f"| {cf.frames} | {r['prompt'] + c.response_len} | {name} | {cf.group_size} | {cf.prompts} | "
            f"{cf.ranks} | {r['peak'] / 2**20:.1f} MiB | {r['time']:.1f} s | {r['encodes']} |",
            flush=True,
        )
    print(
        f"tiny model: {r['params']:,} parameters; 4 bytes each, x 4 with gradients and AdamW states"
    )
    print(
        f"encoding once: {rows['each row encoded']['time'] / rows['vision-once dp 2']['time']:.2f}x"
    )
    print(
        f"per-rank memory sp1/sp2 at {TOP} frames: {rows['sp1']['peak'] / rows['sp2']['peak']:.2f}x"
    )
    print(
        f"long video step speedup: {rows['each row encoded']['time'] / rows['MR-SP sp 2']['time']:.2f}x"
    )
    print(
        f"of which sequence parallel: {rows['vision-once dp 2']['time'] / rows['MR-SP sp 2']['time']:.2f}x"
    )
    print_encodes(c)


def print_encodes(c: memory.Config):
    """The encode count's lines: each step's passes over a prompt, and the goal's line (step 1, the
    samples new: the reference's first sight included). vLLM's own encode for generation comes on
    top of these."""
    trained = encode_counts(c)
    frozen = encode_counts(c, freeze_vision=True)
    for name, counts in (("trained tower", trained), ("freeze_vision", frozen)):
        steps = [
            f"step {k + 1}: policy {s['policy']:g}, reference {s['reference']:g}, "
            f"tower passes recomputed in backward (checkpointing) {s['recomputed']:g}"
            for k, s in enumerate(counts)
        ]
        print(f"{name} (2 mini-batches of 1-row micro-batches, kl_coef): {'; '.join(steps)}")
    print(
        f"vision encodes per prompt and step: {trained[0]['policy'] + trained[0]['reference']:g} "
        f"(trained tower), {frozen[0]['policy'] + frozen[0]['reference']:g} (frozen)"
    )


if __name__ == "__main__":
    default = memory.Config(size=112, group_size=8, kl_coef=0.01, steps=2)
    if "--plan-check" in sys.argv:
        run_phases(sys.argv[sys.argv.index("--plan-check") + 1 :])
    elif "--encodes" in sys.argv:  # the encode count alone (a minute)
        print_encodes(default)
    else:
        import tyro

        main(tyro.cli(memory.Config, default=default))

"""Long videos (issue 14): per-rank peak memory and time of the train phase, frames x sp_size, and today's path.

    .venv/bin/python bench/long_video.py        # about 5 minutes on 2 idle cores

bench/memory.py's worker, a fresh process per setting (sp_size 2: two processes under torchrun, gloo, one thread each;
one process of two threads otherwise): one synthetic clip of F frames at 8 fps read with video_fps 8 and
video_max_frames F, so the model sees all F frames; 56 x 56 pixels make 2 video tokens per frame (2 frames x 2 x 2
patches of 14 px merge into one token). group_size rollouts of response_len random tokens, the train phase of
train.main once. Peak memory per rank: the rank's resident-set rise over the phase (memory_plan.peak_bytes), the
largest over the ranks; time: the slowest rank's. "sp1" and "sp2" run all of issue 13's switches (memory.py's
"all on": frozen vision features, checkpointing, chunked logits, one row per micro-batch) with sp_size 1 and 2;
"today's path" is train.py before issues 13 and 14 (vision per row, no checkpointing, full logits), sp_size 1.
"""
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory  # noqa: E402  (puts the repository first on sys.path)

FRAMES = (128, 256, 512, 1024)
TODAY_FRAMES = 512  # the comparison point for the step speedup


def main(c: memory.Config):
    import train
    has_sp = "sp_size" in train.Config.__dataclass_fields__
    print(f"1 clip x F frames {c.size}x{c.size}, group_size {c.group_size}, {c.response_len} response tokens; load "
          f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings are noisy)")
    print("| frames | tokens per sequence | setting | peak memory per rank | train-phase time | vision encodes |\n"
          "|---|---|---|---|---|---|")
    runs = [(f, "all on", sp) for f in FRAMES for sp in (1, 2)] + [(TODAY_FRAMES, "before #13", 1)]
    rows = {}
    for frames, setting, sp in runs:
        name = f"sp{sp}" if setting == "all on" else "today's path"
        cf = replace(c, frames=frames, sp_size=sp)
        memory.prepare(cf)
        if sp > 1 and not has_sp:
            print(f"| {frames} | | {name} | unavailable: train.Config has no sp_size | | |", flush=True)
            continue
        rows[frames, name] = r = memory.run(cf, setting)
        print(f"| {frames} | {r['prompt'] + c.response_len} | {name} | {r['peak'] / 2 ** 20:.1f} MiB | "
              f"{r['time']:.1f} s | {r['encodes']} |", flush=True)
    top = max(FRAMES)
    if has_sp:
        ratio = rows[top, "sp1"]["peak"] / rows[top, "sp2"]["peak"]
        speedup = rows[TODAY_FRAMES, "today's path"]["time"] / rows[TODAY_FRAMES, "sp2"]["time"]
        print(f"per-rank memory sp1/sp2 at {top} frames: {ratio:.2f}x")
        print(f"long video step speedup: {speedup:.2f}x")
    else:
        speedup = rows[TODAY_FRAMES, "today's path"]["time"] / rows[TODAY_FRAMES, "sp1"]["time"]
        print(f"per-rank memory sp1/sp2 at {top} frames: unavailable (no sp_size)")
        print(f"long video step speedup: unavailable (no sp_size; sp1 all on vs today's path: {speedup:.2f}x)")


if __name__ == "__main__":
    import tyro
    main(tyro.cli(memory.Config, default=memory.Config(prompts=1)))

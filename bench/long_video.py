"""Long videos (issue 14): per-rank peak memory and time of the train phase, frames x sp_size, and today's path.

    .venv/bin/python bench/long_video.py        # about 8 minutes on 2 idle cores

bench/memory.py's worker, a fresh process per setting (2 ranks: torchrun, gloo, one thread each; 1 rank: one process
of two threads): synthetic clips of F frames at 8 fps read with video_fps 8 and video_max_frames F, so the model sees
all F frames; 56 x 56 pixels make 2 video tokens per frame (2 frames x 2 x 2 patches of 14 px merge into one token).
group_size rollouts of response_len random tokens per clip, the train phase of train.main once. Peak memory per rank:
the rank's resident-set rise over the phase (memory.peak_bytes), the largest over the ranks; time: the slowest
rank's. "sp1" / "sp2" run all of issue 13's switches (memory.py's "all on": frozen vision features, checkpointing,
chunked logits, one row per micro-batch) on one clip, with sp_size 1 on 1 rank / sp_size 2 on 2 ranks. The speedup
compares one step of the same 2 clips on the same 2 ranks: "today's path", train.py before issues 13 and 14 (vision
per row, no checkpointing, full logits), data-parallel (a clip per rank), against "MR-SP", "sp2" on both clips.
"""
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory  # noqa: E402  (puts the repository first on sys.path)

FRAMES = (128, 256, 512, 1024)
TODAY_FRAMES = 512  # the comparison point for the step speedup


def main(c: memory.Config):
    print(f"clips of F frames {c.size}x{c.size}, group_size {c.group_size}, {c.response_len} response tokens; load "
          f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings are noisy)")
    print("| frames | tokens per sequence | setting | clips | ranks | peak memory per rank | train-phase time | "
          "vision encodes (rank 0) |\n|---|---|---|---|---|---|---|---|")
    runs = {(f, f"sp{sp}"): ("all on", replace(c, frames=f, prompts=1, ranks=sp, sp_size=sp))
            for f in FRAMES for sp in (1, 2)}
    runs[TODAY_FRAMES, "today's path"] = ("before #13", replace(c, frames=TODAY_FRAMES, prompts=2, ranks=2))
    runs[TODAY_FRAMES, "MR-SP"] = ("all on", replace(c, frames=TODAY_FRAMES, prompts=2, ranks=2, sp_size=2))
    rows = {}
    for (frames, name), (setting, cf) in runs.items():
        memory.prepare(cf)
        rows[frames, name] = r = memory.run(cf, setting)
        print(f"| {frames} | {r['prompt'] + c.response_len} | {name} | {cf.prompts} | {cf.ranks} | "
              f"{r['peak'] / 2 ** 20:.1f} MiB | {r['time']:.1f} s | {r['encodes']} |", flush=True)
    top = max(FRAMES)
    ratio = rows[top, "sp1"]["peak"] / rows[top, "sp2"]["peak"]
    speedup = rows[TODAY_FRAMES, "today's path"]["time"] / rows[TODAY_FRAMES, "MR-SP"]["time"]
    print(f"per-rank memory sp1/sp2 at {top} frames: {ratio:.2f}x")
    print(f"long video step speedup: {speedup:.2f}x")


if __name__ == "__main__":
    import tyro
    main(tyro.cli(memory.Config))

"""Long videos (issue 14): per-rank peak memory and time of a training step, frames x sp_size, and today's path.

    .venv/bin/python bench/long_video.py        # about 5 minutes on 2 idle cores

memory.py's worker, a fresh process per setting: clips of F frames (112 x 112, all seen), group_size 8; a step is
the reference pass (kl_coef 0.01) and the update. What is measured and how: docs/speed.md.
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
    print("| frames | tokens per sequence | setting | clips | ranks | peak memory per rank | step time | "
          "vision encodes (rank 0) |\n|---|---|---|---|---|---|---|---|")
    runs = {(f, f"sp{sp}"): ("all on", replace(c, frames=f, prompts=1, ranks=sp, sp_size=sp))
            for f in FRAMES for sp in (1, 2)}
    timed = replace(c, frames=TODAY_FRAMES, prompts=2, ranks=2, steps=c.steps + 2)  # 3 timed steps: the fastest
    runs[TODAY_FRAMES, "today's path"] = (memory.PER_ROW, timed)
    runs[TODAY_FRAMES, "MR-SP"] = ("freeze_vision", replace(timed, sp_size=2))
    rows = {}
    for (frames, name), (setting, cf) in runs.items():
        memory.prepare(cf)
        rows[frames, name] = r = memory.run(cf, setting)
        print(f"| {frames} | {r['prompt'] + c.response_len} | {name} | {cf.prompts} | {cf.ranks} | "
              f"{r['peak'] / 2 ** 20:.1f} MiB | {r['time']:.1f} s | {r['encodes']} |", flush=True)
    top = max(FRAMES)
    print(f"tiny model: {r['params']:,} parameters; 4 bytes each, x 4 with gradients and AdamW states")
    print(f"per-rank memory sp1/sp2 at {top} frames: {rows[top, 'sp1']['peak'] / rows[top, 'sp2']['peak']:.2f}x")
    speedup = rows[TODAY_FRAMES, "today's path"]["time"] / rows[TODAY_FRAMES, "MR-SP"]["time"]
    print(f"long video step speedup: {speedup:.2f}x")


if __name__ == "__main__":
    import tyro
    main(tyro.cli(memory.Config, default=memory.Config(size=112, group_size=8, kl_coef=0.01, steps=2)))

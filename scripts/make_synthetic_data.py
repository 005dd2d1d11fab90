"""Synthetic video/image tasks with verifiable answers, written as real files (H.264 mp4, PNG, JSONL).

    python scripts/make_synthetic_data.py --out .cache/data/color --tasks color --num-train 512 --num-val 64
    python scripts/make_synthetic_data.py --out .cache/data/big --tasks color --num-train 4 --num-val 0 \
        --width 1280 --height 720 --fps 30 --seconds 60        # realistic size, for bench/cache.py

Tasks (the sample id starts with the task name):
  color        multiple choice: the background color of the whole video (the demo task; a small gray
               distractor square moves on top). Options fixed: A. red B. green C. blue D. yellow.
  direction    multiple choice: which way a big square moves (A. left B. right C. up D. down).
  count        numerical: how many squares are in the video (1-4).
  appear       temporal grounding: when a big square is visible, {"time": [start, end]} in seconds.
  image_color  multiple choice on a PNG image: its background color.
Every sample carries an `offline_output` (the correct answer in the answer format) for mixed
offline-online training. Deterministic by seed; train and val use different random streams.
"""
import argparse
import json
import os

import numpy as np

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 230), "yellow": (235, 220, 30)}
LETTERS = "ABCD"
COLOR_OPTIONS = [f"{L}. {c}" for L, c in zip(LETTERS, COLORS)]
DIRS = ["left", "right", "up", "down"]


def write_video(path: str, frames: np.ndarray, fps: float):
    """uint8 (T, H, W, 3) -> H.264 mp4 (yuv420p, so H and W must be even)."""
    import av
    with av.open(path, "w") as f:
        s = f.add_stream("libx264", rate=int(round(fps)))
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "18"}
        for fr in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(fr), format="rgb24")):
                f.mux(pkt)
        for pkt in s.encode():
            f.mux(pkt)


def canvas(T, H, W, rgb):
    v = np.empty((T, H, W, 3), np.uint8)
    v[:] = rgb
    return v


def square(v, t, y, x, side, rgb):
    H, W = v.shape[1:3]
    y, x = int(np.clip(y, 0, H - side)), int(np.clip(x, 0, W - side))
    v[t, y:y + side, x:x + side] = rgb


def gen_color(rng, T, H, W, fps):
    c = int(rng.integers(4))
    v = canvas(T, H, W, list(COLORS.values())[c])
    side, y, x0 = max(2, min(H, W) // 6), rng.integers(0, H), rng.integers(0, W)
    for t in range(T):  # a small gray square drifting right: motion that carries no answer
        square(v, t, y, x0 + t * max(1, W // (2 * T)), side, (128, 128, 128))
    return v, "What is the background color of the video?", LETTERS[c], COLOR_OPTIONS, "multiple choice", f"<answer>{LETTERS[c]}</answer>"


def gen_direction(rng, T, H, W, fps):
    d = int(rng.integers(4))
    v = canvas(T, H, W, (20, 20, 20))
    side = max(4, min(H, W) // 3)
    span_y, span_x = H - side, W - side
    for t in range(T):
        f = t / max(1, T - 1)
        pos = {0: (span_y / 2, span_x * (1 - f)), 1: (span_y / 2, span_x * f),
               2: (span_y * (1 - f), span_x / 2), 3: (span_y * f, span_x / 2)}[d]
        square(v, t, pos[0], pos[1], side, COLORS["yellow"])
    opts = [f"{L}. {x}" for L, x in zip(LETTERS, DIRS)]
    return (v, "In which direction does the square move?", LETTERS[d], opts, "multiple choice",
            f"<think>The square moves {DIRS[d]}.</think><answer>{LETTERS[d]}</answer>")


def gen_count(rng, T, H, W, fps):
    n = int(rng.integers(1, 5))
    v = canvas(T, H, W, (20, 20, 20))
    side = max(2, min(H, W) // 5)
    cells = rng.permutation(4)[:n]  # one square per quadrant: never overlapping, so the count is exact
    for c in cells:
        y, x = (c // 2) * H // 2 + (H // 2 - side) // 2, (c % 2) * W // 2 + (W // 2 - side) // 2
        for t in range(T):
            square(v, t, y, x, side, COLORS["green"])
    return v, "How many squares are in the video?", str(n), None, "numerical", f"<answer>{n}</answer>"


def gen_appear(rng, T, H, W, fps):
    v = canvas(T, H, W, (20, 20, 20))
    s = int(rng.integers(0, T // 2))
    e = int(rng.integers(s + 1, T))  # visible on frames s..e-1
    side = max(4, min(H, W) // 2)
    for t in range(s, e):
        square(v, t, (H - side) // 2, (W - side) // 2, side, COLORS["blue"])
    ans = json.dumps({"time": [round(s / fps, 2), round(e / fps, 2)]})
    return (v, "When does the square appear? Answer with its start and end time in seconds.", ans, None,
            "temporal grounding", f"<answer>{ans}</answer>")


def gen_image_color(rng, T, H, W, fps):
    v, q, a, opts, pt, off = gen_color(rng, 1, H, W, fps)
    return v[0], "What is the background color of the image?", a, opts, pt, off


TASKS = {"color": gen_color, "direction": gen_direction, "count": gen_count, "appear": gen_appear,
         "image_color": gen_image_color}


def make(out, tasks, num_train, num_val, seed=0, size=56, fps=4, seconds=2.0, width=None, height=None) -> dict:
    """Write DIR/train.jsonl, DIR/val.jsonl and the media. A no-op when DIR/meta.json has the same args."""
    from PIL import Image
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    W, H = width or size, height or size
    args = dict(tasks=tasks, num_train=num_train, num_val=num_val, seed=seed, W=W, H=H, fps=fps, seconds=seconds)
    meta_path = os.path.join(out, "meta.json")
    paths = {s: os.path.join(out, f"{s}.jsonl") for s in ("train", "val")}
    if os.path.exists(meta_path) and json.load(open(meta_path)) == args:
        return paths
    for sub in ("videos", "images"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    T = max(2, int(round(fps * seconds)))
    for split_i, (split, num) in enumerate((("train", num_train), ("val", num_val))):
        rows = []
        for task_i, task in enumerate(tasks):
            rng = np.random.default_rng([seed, split_i, task_i])  # independent streams per split and task
            for i in range(num):
                media, q, a, opts, ptype, offline = TASKS[task](rng, T, H, W, fps)
                sid = f"{task}-{split}-{i:05d}"
                row = {"id": sid, "problem": q, "answer": a, "problem_type": ptype}
                if media.ndim == 3:
                    rel = f"images/{sid}.png"
                    Image.fromarray(media).save(os.path.join(out, rel))
                    row.update(images=[rel], data_type="image")
                else:
                    rel = f"videos/{sid}.mp4"
                    write_video(os.path.join(out, rel), media, fps)
                    row.update(videos=[rel], data_type="video")
                if opts:
                    row["options"] = opts
                row["offline_output"] = offline
                rows.append(row)
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(meta_path, "w") as f:
        json.dump(args, f)
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tasks", default="color", help=f"comma-separated, from {sorted(TASKS)}")
    ap.add_argument("--num-train", type=int, default=256)
    ap.add_argument("--num-val", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=56)
    ap.add_argument("--width", type=int)
    ap.add_argument("--height", type=int)
    ap.add_argument("--fps", type=float, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    print(make(a.out, a.tasks.split(","), a.num_train, a.num_val, a.seed, a.size, a.fps, a.seconds, a.width, a.height))

"""Synthetic video/image tasks with verifiable answers, written as real files (H.264 mp4, PNG, JSONL).

    python scripts/make_synthetic_data.py --out .cache/data/color --tasks color --num-train 512 --num-val 64
    python scripts/make_synthetic_data.py --out .cache/data/big --tasks color --num-train 4 --num-val 0 \
        --width 1280 --height 720 --fps 30 --seconds 60        # realistic size, for the cache benchmark
    python scripts/make_synthetic_data.py --out .cache/data/tone --tasks tone  # answer: the sound

Tasks: TASKS, one gen_<task> each; ids like color-train-00012; every sample has an `offline_output` (its correct
answer). Classes balanced, deterministic by seed; a scene's hash puts it in train or val (disjoint, val independent
of --num-train). JSONL paths are relative to its folder.
A task that returns an 8th value (tone) has a soundtrack: a sine of that frequency (Hz).
"""

import hashlib
import itertools
import json
import math
import os
import time
from fractions import Fraction

import numpy as np

# bump when generated content changes: meta.json then mismatches and make() rewrites the set
VERSION = 6
COLORS = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (30, 60, 230),
    "yellow": (235, 220, 30),
}
LETTERS = "ABCD"
COLOR_OPTIONS = [f"{L}. {c}" for L, c in zip(LETTERS, COLORS)]
DIRS = ["left", "right", "up", "down"]
DIR_OPTIONS = [f"{L}. {d}" for L, d in zip(LETTERS, DIRS)]
TONE_OPTIONS = ["A. 200 Hz", "B. 400 Hz", "C. 800 Hz", "D. 1600 Hz"]  # gen_tone: 200 * 2**c Hz
RATE = 16000  # soundtracks' sampling rate: the Omni processors' (no resampling on the way in)
PALETTE = [
    *COLORS.values(),
    (240, 240, 240),
    (30, 210, 220),
    (220, 40, 220),
    (245, 140, 20),
]  # shapes on dark
VAL_BUCKETS = 8  # 1/8 of each task's scene space belongs to val, the rest to train


def yuv(rgb):
    """BT.601 limited range: exactly what swscale does for rgb24 -> yuv420p, and what decoders assume back."""
    r, g, b = rgb
    return (
        round(16 + (65.481 * r + 128.553 * g + 24.966 * b) / 255),
        round(128 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255),
        round(128 + (112.0 * r - 93.786 * g - 18.214 * b) / 255),
    )


def write_video(path: str, frames, fps: float, pix_fmt: str = "rgb24", tone: float = 0):
    """H.264 mp4, yuv420p (even width and height), frame i at i / fps; written to a .part file, then renamed.
    frames: uint8 (H, W, 3) RGB, streamed from any iterable; or with pix_fmt="yuv420p", (H * 3 // 2, W) planar.
    tone: a soundtrack (AAC, mono, RATE Hz), a sine of this frequency over the clip (0: none)."""
    import av

    frames = iter(frames)
    first = np.asarray(next(frames))
    H, W = (first.shape[0] * 2 // 3, first.shape[1]) if pix_fmt == "yuv420p" else first.shape[:2]
    if first.dtype != np.uint8 or H % 2 or W % 2:
        raise ValueError(
            f"{path}: need uint8 frames with even width and height, got {first.dtype} {W}x{H}"
        )
    # x264's thread pool costs more than it saves on tiny frames
    opts = {"preset": "ultrafast", "crf": "18", "threads": "1" if H * W < 320 * 240 else "0"}
    with av.open(f"{path}.part", "w", format="mp4") as f:
        s = f.add_stream(
            "libx264",
            rate=Fraction(fps).limit_denominator(1001),
            options=opts,
            width=W,
            height=H,
            pix_fmt="yuv420p",
        )
        if tone:
            sound = f.add_stream("aac", rate=RATE, layout="mono")
        for i, fr in enumerate(itertools.chain([first], frames)):
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(fr), format=pix_fmt)
            vf.pts = i  # in 1/fps units (the codec time base), so decoders report exactly i / fps
            f.mux(s.encode(vf))
        f.mux(s.encode())
        if tone:
            t = np.arange(round((i + 1) / fps * RATE)) / RATE
            af = av.AudioFrame.from_ndarray(
                0.25 * np.sin(2 * np.pi * tone * t)[None], "dbl", "mono"
            )
            af.sample_rate = RATE
            af.pts = 0  # else the encoder's priming samples are not trimmed on decoding
            f.mux(sound.encode(af))
            f.mux(sound.encode())
    os.replace(f"{path}.part", path)


# ---- scenes: a flat background plus axis-aligned rectangles per frame, as plain ints -----------------------
# A scene is data, not pixels: it is hashed (dedup, train/val split) and rendered straight to RGB (PNG) or to
# planar YUV (video: no per-pixel color conversion, which halves the encode time of a 720p clip).


def rect(y, x, h, w, rgb):
    """Snapped to even coordinates/sizes, so the 2x2 chroma blocks of yuv420p never straddle a shape edge; rgb: a
    tuple of Python ints (every caller's color), hashed with the scene as it is."""
    return (
        int(y) // 2 * 2,
        int(x) // 2 * 2,
        -(-int(h) // 2) * 2,
        -(-int(w) // 2) * 2,
        rgb,
    )


def render_rgb(H, W, bg, rects):
    f = np.empty((H, W, 3), np.uint8)
    for y, x, h, w, c in [
        (0, 0, H, W, bg),
        *rects,
    ]:  # the background is a rectangle over the whole frame
        f[y : y + h, x : x + w] = c
    return f


def render_yuv(H, W, bg, rects):
    f = np.empty(
        (H * 3 // 2, W), np.uint8
    )  # the layout av.VideoFrame.from_ndarray(format="yuv420p") takes
    planes = (
        f[:H],
        *f.reshape(-1)[H * W :].reshape(2, H // 2, W // 2),
    )  # Y; U, V one after the other
    for y, x, h, w, c in [(0, 0, H, W, bg), *rects]:
        for plane, value, scale in zip(planes, yuv(c), (1, 2, 2)):  # U and V at half resolution
            plane[y // scale : (y + h) // scale, x // scale : (x + w) // scale] = value
    return f


def path(p0, p1, T):
    """T points from p0 to p1 at constant speed."""
    return [p0 + (p1 - p0) * t / max(1, T - 1) for t in range(T)]


def glide(rng, T, H, W, side):
    """A path between two random in-frame top-left corners of a side x side square, at least a side apart."""

    def corner():
        return np.array([rng.integers(0, H - side + 1), rng.integers(0, W - side + 1)])

    p0 = corner()
    p1 = corner()
    while np.abs(p1 - p0).max() < side:
        p1 = corner()
    return path(p0, p1, T)


def dark(rng):
    g = int(rng.integers(10, 60))
    return (g, g, g)


# ---- tasks: gen(rng, label, T, H, W, fps) -> (bg, rects per frame, problem, answer, options, type, offline) ----


def gen_color(rng, c, T, H, W, fps, kind="video"):
    """The demo task: the background's color; a gray or white square moves on top and carries no answer."""
    side = max(2, min(H, W) // 6)
    shade = (128, 128, 128) if rng.integers(2) else (235, 235, 235)
    rects = [[rect(y, x, side, side, shade)] for y, x in glide(rng, T, H, W, side)]
    L = LETTERS[c]
    return (
        list(COLORS.values())[c],
        rects,
        f"What is the background color of the {kind}?",
        L,
        COLOR_OPTIONS,
        "multiple choice",
        f"<answer>{L}</answer>",
    )


def gen_image_color(rng, c, T, H, W, fps):
    return gen_color(rng, c, 1, H, W, fps, "image")


def gen_direction(rng, d, T, H, W, fps):
    side = math.ceil(min(H, W) / 3)
    span = (W if d < 2 else H) - side  # along the motion axis
    a0 = rng.integers(0, span // 4 + 1)
    a1 = span - rng.integers(0, span // 4 + 1)  # travels >= half the frame
    if d in (0, 2):
        a0, a1 = a1, a0  # left / up: decreasing coordinate
    perp = rng.integers(0, (H if d < 2 else W) - side + 1)
    color = PALETTE[rng.integers(len(PALETTE))]
    ends = [
        np.array([perp, a]) if d < 2 else np.array([a, perp]) for a in (a0, a1)
    ]  # (y, x) top-left corners
    rects = [[rect(y, x, side, side, color)] for y, x in path(*ends, T)]
    L = LETTERS[d]
    return (
        dark(rng),
        rects,
        "In which direction does the square move?",
        L,
        DIR_OPTIONS,
        "multiple choice",
        f"<think>The square moves {DIRS[d]}.</think><answer>{L}</answer>",
    )


def gen_count(rng, k, T, H, W, fps):
    n = k + 1
    side = 2 * max(1, min(H, W) // 10)
    shapes = []
    for q in sorted(
        rng.choice(4, n, replace=False)
    ):  # one per quadrant: never overlapping, the count is exact
        qy = (q // 2) * (H // 2)
        qx = (q % 2) * (W // 2)
        # starts kept >= 1 px inside the quadrant so snapping down to even cannot push a square out of it
        y = qy + rng.integers(1, H // 2 - side)
        x = qx + rng.integers(1, W // 2 - side)
        shapes.append(rect(y, x, side, side, PALETTE[rng.integers(len(PALETTE))]))
    return (
        dark(rng),
        [shapes] * T,
        "How many shapes are in the video?",
        str(n),
        None,
        "numerical",
        f"<answer>{n}</answer>",
    )


def gen_appear(rng, _, T, H, W, fps):
    s = int(rng.integers(1, T - 1))  # first visible frame, >= 1: the shape really appears
    e = int(rng.integers(s + 1, T))  # first frame without it, <= T - 1: it really disappears
    side = min(H, W) // 2
    y = rng.integers(0, H - side + 1)
    x = rng.integers(0, W - side + 1)
    r = rect(y, x, side, side, PALETTE[rng.integers(len(PALETTE))])
    ans = json.dumps({"time": [round(s / fps, 2), round(e / fps, 2)]})
    return (
        dark(rng),
        [[r] if s <= t < e else [] for t in range(T)],
        "When does the shape appear? Answer with start and end seconds.",
        ans,
        None,
        "temporal grounding",
        f"<answer>{ans}</answer>",
    )


def gen_needle(rng, c, T, H, W, fps):
    """For long clips: the gray background turns a color for T // 8 frames (4 of 256 sampled frames often miss it)."""
    E = max(1, T // 8)
    side = max(2, min(H, W) // 3)  # the event's frames; the squares' side
    start = int(rng.integers(0, T - E + 1))
    flash = [rect(0, 0, H, W, list(COLORS.values())[c])]
    # fixed grays: the squares' paths are the only distraction, so the clip's gray content says nothing of the answer
    squares = [
        [rect(*p, side, side, (g, g, g)) for p in glide(rng, T, H, W, side)] for g in (110, 200)
    ]
    rects = [
        [*(flash if start <= t < start + E else []), *frame]
        for t, frame in enumerate(zip(*squares))
    ]
    L = LETTERS[c]
    return (
        (40, 40, 40),
        rects,
        "What color does the background briefly turn?",
        L,
        COLOR_OPTIONS,
        "multiple choice",
        f"<answer>{L}</answer>",
    )


def gen_tone(rng, c, T, H, W, fps):
    """Audio-visual: the soundtrack's pitch class (200 * 2**c Hz, up to a quarter octave off); every
    video shows the same gray picture, so a model that does not hear stays at chance."""
    L = LETTERS[c]
    return (
        (128, 128, 128),
        [[]] * T,
        "Which tone is heard in the video?",
        L,
        TONE_OPTIONS,
        "multiple choice",
        f"<answer>{L}</answer>",
        # the tone (Hz): only this task has an 8th value
        round(200 * 2 ** (c + rng.uniform(-0.25, 0.25)), 1),
    )


# name -> (generator, number of balanced classes (0: none), data type, minimum frames)
TASKS = {
    "color": (gen_color, 4, "video", 2),
    "direction": (gen_direction, 4, "video", 2),
    "count": (gen_count, 4, "video", 1),
    "appear": (gen_appear, 0, "video", 3),
    "image_color": (gen_image_color, 4, "image", 1),
    "needle": (gen_needle, 4, "video", 2),
    "tone": (gen_tone, 4, "video", 2),  # last: the other tasks' streams keep their index
}


def _done(out, args, paths) -> bool:
    """meta.json has the same args and every JSONL and the media it lists exist."""
    try:
        with open(paths["meta"]) as f:
            if json.load(f) != args:
                return False
        rows = [json.loads(line) for split in ("train", "val") for line in open(paths[split])]
    except (OSError, ValueError):
        return False
    return all(
        os.path.exists(os.path.join(out, m))
        for r in rows
        for m in r.get("videos", []) + r.get("images", [])
    )


def make(
    out: str,
    tasks: str | list[str] = "color",
    num_train: int = 256,
    num_val: int = 64,
    seed: int = 0,
    size: int = 56,
    fps: float = 4,
    seconds: float = 2.0,
    width: int | None = None,
    height: int | None = None,
):
    """Write out/{train,val}.jsonl (num_train, num_val per task), the media and out/meta.json (a no-op when it holds
    the same arguments); returns {"train", "val", "meta"} paths. size: the side where width or height is not given."""
    from PIL import Image

    tasks = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    W = int(width or size)
    H = int(height or size)
    T = round(fps * seconds)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known: {list(TASKS)}")
    if W % 2 or H % 2 or min(W, H) < 16:
        raise ValueError(f"frame {W}x{H}: width and height must be even (yuv420p) and >= 16")
    need = max([TASKS[t][3] for t in tasks if TASKS[t][2] == "video"], default=1)
    if T < need:
        raise ValueError(f"fps * seconds = {T} frames; tasks {tasks} need at least {need}")
    args = dict(
        version=VERSION,
        tasks=tasks,
        num_train=num_train,
        num_val=num_val,
        seed=seed,
        width=W,
        height=H,
        fps=fps,
        seconds=seconds,
    )
    paths = {
        "train": os.path.join(out, "train.jsonl"),
        "val": os.path.join(out, "val.jsonl"),
        "meta": os.path.join(out, "meta.json"),
    }
    if _done(out, args, paths):
        return paths
    for sub in ("videos", "images"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    if os.path.exists(paths["meta"]):
        os.remove(paths["meta"])  # written last: its presence means the set is complete
    for split_i, (split, num) in enumerate((("train", num_train), ("val", num_val))):
        rows = []
        for task in tasks:
            gen, n_cls, dtype, _ = TASKS[task]
            # the stream depends on (seed, split, task) only: adding a task or resizing the other split changes nothing
            rng = np.random.default_rng([seed, split_i, list(TASKS).index(task)])
            labels = rng.permutation(np.arange(num) % n_cls) if n_cls else np.zeros(num, int)
            seen = set()
            for i in range(num):
                for _ in range(
                    10000
                ):  # rejection: wrong split bucket, or a repeat within this split
                    bg, rects, problem, answer, options, ptype, offline, *tone = gen(
                        rng, int(labels[i]), T, H, W, fps
                    )
                    key = hashlib.sha1(repr((task, bg, rects, *tone)).encode()).digest()
                    if (key[0] % VAL_BUCKETS == 0) == (split == "val") and key not in seen:
                        break
                else:
                    raise RuntimeError(
                        f"{task}: no new {split} scene after 10000 draws; "
                        "use a larger frame or fewer samples"
                    )
                seen.add(key)
                sid = f"{task}-{split}-{i:05d}"
                media = f"{dtype}s/{sid}.{'png' if dtype == 'image' else 'mp4'}"
                if dtype == "image":
                    Image.fromarray(render_rgb(H, W, bg, rects[0])).save(os.path.join(out, media))
                else:
                    write_video(
                        os.path.join(out, media),
                        (render_yuv(H, W, bg, r) for r in rects),
                        fps,
                        "yuv420p",
                        *tone,
                    )
                row = {
                    "id": sid,
                    "problem": problem,
                    "answer": answer,
                    f"{dtype}s": [media],
                    "data_type": dtype,
                    "problem_type": ptype,
                    "options": options,
                    "offline_output": offline,
                }
                rows.append(
                    {k: v for k, v in row.items() if v is not None}
                )  # no options: the field is left out
        with open(f"{paths[split]}.part", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(f"{paths[split]}.part", paths[split])
    with open(paths["meta"], "w") as f:
        json.dump(args, f)
    return paths


if __name__ == "__main__":
    import tyro

    t0 = time.time()
    p = tyro.cli(make)
    print(f"{p['train']} {p['val']} ({time.time() - t0:.1f}s)")

"""cache.py: decode every video once, ever. Frames are sampled and resized exactly as Qwen's reference
preprocessing (qwen-vl-utils: smart_nframes, linspace indices, smart_resize, bicubic+antialias on uint8)
and stored as uint8 safetensors, 4x smaller than EasyVideoR1's float32 .pt files.

    python cache.py --data train.jsonl --data val.jsonl --out .cache/frames --workers 2 \
        --fps 2 --max-frames 32 --min-pixels 3136 --max-pixels 100352 --factor 28

Training, rollout and evaluation call `load_video(path, ...)` with the same settings. mode:
    prefer_cache   read the entry if it is there, else decode and write it (the next access hits)
    cache_only     a missing entry is an error naming the video and the key
    decode_only    never touch the cache (the baseline of bench/cache.py)
The key hashes everything that changes the frames: the video's absolute path, size and mtime (an
edited file is a miss, never served stale), every frame setting, the patch factor and FORMAT. Writes
go to a temp file then os.replace, so a killed process or two writers never leave a torn entry; a
truncated or corrupt entry fails its crc32 or safetensors' own checks, is reported and rebuilt.
"""
import hashlib
import json
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

FORMAT = "nvr1-frames-v1"


class VideoError(ValueError):
    """A video that cannot be decoded; the message names the file and the cause."""


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    from qwen_vl_utils.vision_process import smart_resize as ref  # the reference math, not a copy of it
    return ref(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def sample_indices(total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """qwen-vl-utils: frame count by fps, clamped to [min, max], floored to the temporal patch (2);
    indices evenly spaced over the whole video and rounded."""
    from qwen_vl_utils.vision_process import smart_nframes
    n = smart_nframes({"fps": fps, "min_frames": min_frames, "max_frames": max_frames}, total_frames, video_fps)
    return np.round(np.linspace(0, total_frames - 1, n)).astype(int).tolist()


def frame_pixels(n: int, min_pixels: int, max_pixels: int, total_pixels: int | None, factor: int) -> int:
    """Per-frame pixel cap, as qwen-vl-utils derives it from the total budget over n frames."""
    total = total_pixels or 128000 * factor * factor * 0.9
    return min(max_pixels, max(min(768 * factor * factor, total / n * 2), int(min_pixels * 1.05)))


def resize(frames: np.ndarray, h: int, w: int) -> np.ndarray:
    """uint8 (T, H, W, 3) -> uint8 (T, h, w, 3); torchvision bicubic+antialias on uint8, as the reference."""
    import torch
    from torchvision.transforms.functional import InterpolationMode, resize as tv_resize
    x = torch.from_numpy(np.require(frames, requirements="W")).permute(0, 3, 1, 2)
    if x.shape[-2:] != (h, w):
        x = tv_resize(x, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def decode_video(path: str, fps: float, min_frames: int, max_frames: int, min_pixels: int, max_pixels: int,
                 total_pixels: int | None, factor: int) -> tuple[np.ndarray, dict]:
    """Decode with decord, sample, resize. Raises VideoError naming the file."""
    import decord
    try:
        vr = decord.VideoReader(path, num_threads=1)
        total, vfps = len(vr), float(vr.get_avg_fps())
        if total < 2 or vfps <= 0:
            raise VideoError(f"{path}: video has {total} frames at {vfps} fps (need at least 2 frames)")
        idx = sample_indices(total, vfps, fps, min_frames, max_frames)
        frames = vr.get_batch(idx).asnumpy()
    except VideoError:
        raise
    except (RuntimeError, decord.DECORDError, ValueError, OSError) as e:
        raise VideoError(f"{path}: cannot decode video ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    H, W = frames.shape[1:3]
    h, w = smart_resize(H, W, factor, min_pixels, frame_pixels(len(idx), min_pixels, max_pixels, total_pixels, factor))
    meta = dict(fps=vfps, duration=total / vfps, total_num_frames=total, frames_indices=idx,
                sample_fps=len(idx) / total * vfps, height=h, width=w, video_backend="decord")
    return resize(frames, h, w), meta


def cache_key(path: str, **settings) -> str:
    st = os.stat(path)
    ident = dict(format=FORMAT, path=os.path.abspath(path), size=st.st_size, mtime_ns=st.st_mtime_ns, **settings)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def read_entry(file: str) -> tuple[np.ndarray, dict]:
    """Raises ValueError on a torn or corrupt entry (safetensors' size checks + our crc32)."""
    from safetensors import safe_open
    try:
        with safe_open(file, "np") as f:
            meta, frames = f.metadata(), f.get_tensor("frames")
    except Exception as e:  # safetensors raises its own SafetensorError / OSError / ValueError variants
        raise ValueError(f"{file}: unreadable cache entry ({type(e).__name__}: {e})") from e
    if not meta or zlib.crc32(frames.tobytes()) != int(meta.get("crc32", -1)):
        raise ValueError(f"{file}: cache entry fails its checksum")
    return frames, json.loads(meta["video"])


def write_entry(file: str, frames: np.ndarray, meta: dict):
    from safetensors.numpy import save_file
    os.makedirs(os.path.dirname(file), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), suffix=".tmp")
    os.close(fd)
    try:
        save_file({"frames": frames}, tmp, metadata={"video": json.dumps(meta), "crc32": str(zlib.crc32(frames.tobytes()))})
        os.replace(tmp, file)  # atomic: readers see the old entry, no entry, or the whole new one
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_video(path: str, *, fps: float = 2.0, min_frames: int = 4, max_frames: int = 64, min_pixels: int = 3136,
               max_pixels: int = 100352, total_pixels: int | None = None, factor: int = 28, cache_dir: str | None = None,
               mode: str = "prefer_cache", stats: dict | None = None) -> tuple[np.ndarray, dict]:
    """Frames uint8 (T, H, W, 3), sampled and resized, and their metadata; from the cache or decoded."""
    if mode not in ("prefer_cache", "cache_only", "decode_only"):
        raise ValueError(f"video_source/mode must be prefer_cache, cache_only or decode_only, got {mode!r}")
    stats = stats if stats is not None else {}
    if not os.path.isfile(path):
        raise VideoError(f"{path}: video file not found")
    settings = dict(fps=fps, min_frames=min_frames, max_frames=max_frames, min_pixels=min_pixels,
                    max_pixels=max_pixels, total_pixels=total_pixels or None, factor=factor)
    file = None
    if cache_dir and mode != "decode_only":
        key = cache_key(path, **settings)
        file = os.path.join(cache_dir, key[:2], key + ".safetensors")
        if os.path.exists(file):
            try:
                out = read_entry(file)
                stats["cache_hit"] = stats.get("cache_hit", 0) + 1
                return out
            except ValueError as e:
                print(f"cache: {e}; rebuilding", file=sys.stderr)
                stats["cache_corrupt"] = stats.get("cache_corrupt", 0) + 1
        stats["cache_miss"] = stats.get("cache_miss", 0) + 1
        if mode == "cache_only":
            raise VideoError(f"{path}: no cache entry {file} (mode cache_only; run `python cache.py` first)")
    t = time.time()
    frames, meta = decode_video(path, **settings)
    stats["decode"] = stats.get("decode", 0) + 1
    stats["decode_s"] = stats.get("decode_s", 0.0) + time.time() - t
    if file:
        write_entry(file, frames, meta)
    return frames, meta


def load_image(path: str, *, min_pixels: int, max_pixels: int, factor: int = 28) -> np.ndarray:
    """uint8 (H, W, 3), smart-resized to the factor within the image pixel budget."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            arr = np.asarray(im)
    except (OSError, UnidentifiedImageError) as e:
        raise VideoError(f"{path}: cannot read image ({type(e).__name__}: {e})") from e
    h, w = smart_resize(arr.shape[0], arr.shape[1], factor, min_pixels, max_pixels)
    return resize(arr[None], h, w)[0]


# ---------------------------------------------------------------------------------------------------
@dataclass
class Config:
    data: list[str] = field(default_factory=list)
    """JSON/JSONL files whose `videos` to preprocess (paths relative to each file's folder)"""
    out: str = ".cache/frames"
    """cache folder (train.py's --cache-dir)"""
    workers: int = 2
    """decoding processes"""
    fps: float = 2.0
    """frames per second (train.py's --video-fps)"""
    min_frames: int = 4
    """train.py's --video-min-frames"""
    max_frames: int = 32
    """train.py's --video-max-frames"""
    min_pixels: int = 3136
    """train.py's --video-min-pixels"""
    max_pixels: int = 100352
    """train.py's --video-max-pixels"""
    total_pixels: int = 0
    """train.py's --video-total-pixels (0 = the reference default)"""
    factor: int = 28
    """patch x merge: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL"""


def _one(args):
    path, c = args
    stats = {}
    try:
        load_video(path, fps=c.fps, min_frames=c.min_frames, max_frames=c.max_frames, min_pixels=c.min_pixels,
                   max_pixels=c.max_pixels, total_pixels=c.total_pixels, factor=c.factor, cache_dir=c.out, stats=stats)
        return path, stats, None
    except (VideoError, OSError) as e:
        return path, stats, str(e)


def preprocess(c: Config) -> dict:
    """Decode each distinct video of the data files once into the cache; failures go to a report."""
    from concurrent.futures import ProcessPoolExecutor
    from tqdm import tqdm
    videos = []
    for f in c.data:
        root = os.path.dirname(os.path.abspath(f))
        with open(f) as fh:
            rows = json.load(fh) if f.endswith(".json") else [json.loads(l) for l in fh if l.strip()]
        videos += [p if os.path.isabs(p) else os.path.join(root, p) for r in rows for p in r.get("videos", [])]
    videos = list(dict.fromkeys(videos))  # duplicates across samples are decoded once
    t, total, failed = time.time(), {"videos": len(videos), "cache_hit": 0, "decode": 0, "failed": 0}, []
    with ProcessPoolExecutor(c.workers) as ex:
        for path, stats, err in tqdm(ex.map(_one, [(v, c) for v in videos]), total=len(videos), desc="videos"):
            total["cache_hit"] += stats.get("cache_hit", 0)
            total["decode"] += stats.get("decode", 0)
            if err:
                failed.append({"video": path, "error": err})
    total["failed"] = len(failed)
    os.makedirs(c.out, exist_ok=True)
    with open(os.path.join(c.out, "failed.jsonl"), "w") as fh:
        fh.writelines(json.dumps(x) + "\n" for x in failed)
    total["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(c.out) for f in fs if f.endswith(".safetensors"))
    total["seconds"] = round(time.time() - t, 2)
    return total


if __name__ == "__main__":
    import tyro
    summary = preprocess(tyro.cli(Config))
    print(" | ".join(f"{k} {v}" for k, v in summary.items()))

"""cache.py: decode every video once, ever. Frames are sampled and resized exactly as Qwen's reference
(qwen-vl-utils: smart_nframes, linspace indices, smart_resize, bicubic+antialias on uint8) and stored as
uint8 safetensors, 4x smaller than EasyVideoR1's float32 .pt files. scripts/cache_frames.py fills the cache
ahead of a run (README "Frame cache"). The key hashes FORMAT, the video's absolute path, size and mtime (an
edited file is a miss, never stale) and every frame setting. Writes are atomic (temp file + os.replace); a
per-key lock makes concurrent loaders decode once. An entry that cannot be locked or written (a read-only
cache, a full disk) is counted (cache_unwritable); its frames are used uncached.
A video's soundtrack (load_audio, for Omni thinkers: mono float32 over the frames' window) goes
through the same entries (load_entry), with its own key (rate, max_s, end), checks and modes.
"""

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

from common import (
    ANSWERS,
    MAY_CHANGE_ON_RESUME,
    NOT_NEGATIVE,
    POSITIVE,
    UserError,
    choice_error,
    fact,
)

# bump when stored frames or metadata change: every older entry becomes a miss
FORMAT = "nvr1-frames-v3"
# 8K; decoding + resizing costs ~46 bytes per pixel of one frame (LOG.md): ~1.5 GB
MAX_DECODE_PIXELS = 7680 * 4320


VideoSource = Literal["prefer_cache", "cache_only", "decode_only"]


@dataclass
class Frames:
    """How a video becomes frames: the settings scripts/cache_frames.py's, train.py's and evaluate.py's Config
    inherit (one declaration, one flag name each). The defaults are training's; evaluate.py raises
    video_max_frames/pixels."""

    video_fps: float = fact(2.0, POSITIVE, ANSWERS)
    """frames sampled per second of video"""
    video_min_frames: int = fact(4, POSITIVE, ANSWERS)
    """at least this many frames per video"""
    video_max_frames: int = fact(32, ANSWERS)
    """at most this many frames per video"""
    video_min_pixels: int = fact(3136, ANSWERS)
    """min pixels per frame (smart-resize lower bound)"""
    video_max_pixels: int = fact(100352, ANSWERS)
    """max pixels per frame"""
    video_total_pixels: int = fact(0, NOT_NEGATIVE, ANSWERS)
    """pixel budget over all frames of a video (0 = qwen-vl-utils' default: 128000 tokens, <= 768 per frame)"""
    max_decode_pixels: int = MAX_DECODE_PIXELS
    """videos and images with more pixels per frame are refused before decoding (default: 8K, 7680x4320)"""

    def settings(self, factor: int) -> dict:
        """What an entry's key hashes and decode_video reads, for a model of this patch x merge `factor`."""
        return dict(
            fps=self.video_fps,
            min_frames=self.video_min_frames,
            max_frames=self.video_max_frames,
            min_pixels=self.video_min_pixels,
            max_pixels=self.video_max_pixels,
            total_pixels=self.video_total_pixels or 0,  # None = 0: one key
            factor=factor,
        )


@dataclass
class Media(Frames):
    """Frames, images and where frames come from: the settings data.prepare reads (train.py's and evaluate.py's
    Config are ones)."""

    image_min_pixels: int = fact(3136, ANSWERS)
    """min pixels per image"""
    image_max_pixels: int = fact(1003520, ANSWERS)
    """max pixels per image"""
    video_source: VideoSource = fact("prefer_cache", MAY_CHANGE_ON_RESUME)
    """prefer_cache (read the entry, else decode and write it) | cache_only | decode_only (no cache)"""
    cache_dir: str = fact(".cache/frames", MAY_CHANGE_ON_RESUME)
    """frame cache folder ('' = no cache)"""
    video_audio: bool = fact(False, ANSWERS)
    """the video's soundtrack in the prompt (Omni thinkers: use_audio_in_video; load_audio)"""
    no_audio: Literal["silence", "error"] = fact("error", ANSWERS)
    """a video without an audio track, under video_audio: silence over the frames' window | error
    (the sample fails, naming the file); counted either way (audio_missing)"""
    allow_outside_media: bool = fact(False, MAY_CHANGE_ON_RESUME)
    """read media paths that resolve (symlinks followed) outside their data file's folder
    (evaluate.py: video_dir/<benchmark>); off, such a path is an error naming the sample"""


class VideoError(UserError):
    """A video that cannot be decoded; the message names the file and the cause."""


def vision_factor(processor) -> int:
    """patch_size x merge_size: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL."""
    ip = processor.image_processor
    return ip.patch_size * ip.merge_size


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    # the reference math, not a copy of it
    from qwen_vl_utils.vision_process import smart_resize as ref

    h, w = ref(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    # a side is at least one factor (transformers' smart_resize): qwen-vl-utils 0.0.14 floors a 16:9
    # frame under a one-token budget (720x1280 at 784 px) to height 0, which no resize can make
    return max(h, factor), max(w, factor)


def sample_indices(
    total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int
) -> list[int]:
    """qwen-vl-utils: frame count by fps, clamped to [min, max], floored to the temporal patch (2);
    indices evenly spaced over the whole video and rounded (float32 linspace, as the reference)."""
    import torch
    from qwen_vl_utils.vision_process import smart_nframes

    n = smart_nframes(
        {"fps": fps, "min_frames": min_frames, "max_frames": max_frames}, total_frames, video_fps
    )
    return torch.linspace(0, total_frames - 1, n).round().long().tolist()


def frame_pixels(n: int, min_pixels: int, max_pixels: int, total_pixels: int, factor: int) -> int:
    """Per-frame pixel cap, as qwen-vl-utils derives it from the total budget over n frames (0: its default)."""
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


def decode_video(
    path: str,
    fps: float,
    min_frames: int,
    max_frames: int,
    min_pixels: int,
    max_pixels: int,
    total_pixels: int,
    factor: int,
    max_decode_pixels: int = MAX_DECODE_PIXELS,
    end: float | None = None,
) -> tuple[np.ndarray, dict]:
    """Decode with decord, sample, resize, one frame at a time (peak memory: one full-size frame, not all of them).
    end: the video is its first `end` seconds (the frames before that moment), as if cut there.
    Frames over max_decode_pixels are refused from the container header. Raises VideoError naming the file."""
    import av
    import decord

    try:
        with av.open(path) as container:  # reads the header only: nothing is decoded yet
            codec = container.streams.video[0].codec_context
        if codec.width * codec.height > max_decode_pixels:
            raise VideoError(
                f"{path}: frames of {codec.width}x{codec.height} are over max_decode_pixels="
                f"{max_decode_pixels}"
            )
        vr = decord.VideoReader(path, num_threads=1)
        total = len(vr)
        vfps = float(vr.get_avg_fps())
        if end is not None:
            total = min(total, math.ceil(end * vfps))
        if total < 2 or vfps <= 0:
            raise VideoError(
                f"{path}: video has {total} frames at {vfps} fps (need at least 2 frames)"
            )
        idx = sample_indices(total, vfps, fps, min_frames, max_frames)
        cap = frame_pixels(len(idx), min_pixels, max_pixels, total_pixels, factor)
        frames = []
        for i in idx:  # resizing a frame is independent of the others: the same pixels as one batch
            frame = vr.get_batch([i]).asnumpy()
            h, w = smart_resize(frame.shape[1], frame.shape[2], factor, min_pixels, cap)
            frames.append(resize(frame, h, w))
        frames = np.concatenate(frames)  # frames whose size changes mid-video fail here
    except VideoError:
        raise
    except (RuntimeError, decord.DECORDError, ValueError, OSError, IndexError, av.FFmpegError) as e:
        raise VideoError(
            f"{path}: cannot decode video ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e
    return frames, video_meta(total, vfps, idx, frames.shape[1], frames.shape[2])


def decode_audio(
    path: str, rate: int, max_s: float, end: float | None = None
) -> tuple[np.ndarray, dict]:
    """The soundtrack, mono float32 at `rate` Hz (PyAV's resampler), over the frames' window: from 0
    to `end` or to the video's end (the container's duration), at most max_s seconds: its first
    round(min(window, max_s) * rate) samples (fewer where the track ends sooner). The metadata:
    clipped (the window was over max_s) and missing (no audio track: as many zeros). Raises
    VideoError naming the file."""
    import av

    try:
        with av.open(path) as container:
            # the frames' window (data.prepare) within the container's duration (some have none)
            seconds = min((container.duration or math.inf) / av.time_base, end or math.inf)
            n = round(min(seconds, max_s) * rate)
            missing = not container.streams.audio
            chunks = [np.zeros(n, np.float32)]
            if not missing:
                chunks = []
                got = 0
                resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
                for frame in container.decode(audio=0):
                    for out in resampler.resample(frame):
                        chunks.append(out.to_ndarray()[0])
                        got += out.samples
                    if got >= n:  # the first n samples are final: the rest is not read
                        break
                chunks += [out.to_ndarray()[0] for out in resampler.resample(None)]
            audio = np.concatenate(chunks)[:n]
    except (TypeError, ValueError, av.FFmpegError) as e:
        raise VideoError(
            f"{path}: cannot decode audio ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e
    return audio, dict(clipped=seconds > max_s, missing=missing)


def audio_fits(audio: np.ndarray, meta: dict, settings: dict) -> bool:
    """Whether (audio, meta) are what decode_audio makes: float32 1-D and its two flags (the key
    holds the settings, the checksum the samples)."""
    return audio.dtype == np.float32 and audio.ndim == 1 and sorted(meta) == ["clipped", "missing"]


def video_meta(total: int, vfps: float, idx: list[int], height: int, width: int) -> dict:
    """The metadata of sampled frames: what decode_video returns, the cache stores and check_entry expects."""
    return dict(
        fps=vfps,
        duration=total / vfps,
        total_num_frames=total,
        frames_indices=idx,
        sample_fps=len(idx) / total * vfps,
        height=height,
        width=width,
        video_backend="decord",
    )


def entry_path(cache_dir: str, path: str, settings: dict) -> str:
    """cache_dir/ab/abcd...(32 hex).safetensors; the hash covers FORMAT, the file's identity and the settings."""
    return entry_file(cache_dir, dict(format=FORMAT, **identity(path), **settings))


def identity(path: str) -> dict:
    """A media file's identity in a cache key: its absolute path, size and mtime (an edited file
    is a miss, never stale)."""
    st = os.stat(path)
    return dict(path=os.path.abspath(path), size=st.st_size, mtime_ns=st.st_mtime_ns)


def entry_file(folder: str, ident: dict) -> str:
    """folder/ab/abcd...(32 hex).safetensors, the hash of `ident` (the frame cache's, sp.FeatureCache's)."""
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(folder, key[:2], key + ".safetensors")


def checksum(file: str, frames: np.ndarray, video: str) -> str:
    """crc32 over the entry's key (its file name), its metadata and its array: a copied or edited
    entry fails it."""
    crc = zlib.crc32(os.path.basename(file).encode())
    crc = zlib.crc32(video.encode(), crc)
    return str(zlib.crc32(frames.tobytes(), crc))


def read_entry(file: str) -> tuple[np.ndarray, dict]:
    """(frames, metadata); raises ValueError on a torn, corrupt or edited entry: safetensors' size checks, our crc32
    (check_entry then checks that the content is what its key's settings make)."""
    from safetensors import safe_open

    try:
        with safe_open(file, "np") as f:
            meta = f.metadata() or {}
            frames = f.get_tensor("frames")
    # safetensors raises its own SafetensorError / OSError / ValueError variants
    except Exception as e:
        raise ValueError(f"{file}: unreadable cache entry ({type(e).__name__}: {e})") from e
    if "video" not in meta or meta.get("crc32") != checksum(file, frames, meta["video"]):
        raise ValueError(f"{file}: cache entry fails its checksum")
    return frames, json.loads(meta["video"])


def video_fits(frames: np.ndarray, meta: dict, settings: dict) -> bool:
    """Whether (frames, meta) are what decode_video makes under the key's settings: uint8 (T, H, W,
    3), the metadata and frame count following from the video's frame count, its fps and the
    settings, the size within the pixel cap."""
    total, vfps = meta["total_num_frames"], meta["fps"]
    h, w = frames.shape[1:3]
    idx = sample_indices(
        total, vfps, settings["fps"], settings["min_frames"], settings["max_frames"]
    )
    cap = frame_pixels(
        len(idx),
        settings["min_pixels"],
        settings["max_pixels"],
        settings["total_pixels"],
        settings["factor"],
    )
    return (
        meta == video_meta(total, vfps, idx, h, w)
        and frames.dtype == np.uint8
        and frames.shape == (len(idx), h, w, 3)
        and h % settings["factor"] == w % settings["factor"] == 0
        and 0 < h * w <= cap
    )


def check_entry(file: str, settings: dict, fits) -> tuple[np.ndarray, dict]:
    """The entry's (array, metadata) if `fits(array, metadata, settings)` (video_fits, audio_fits):
    what its key's settings make; else ValueError, as read_entry's (metadata that fits cannot read
    does not fit)."""
    array, meta = read_entry(file)
    try:
        ok = fits(array, meta, settings)
    except (KeyError, TypeError, ValueError, ArithmeticError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(
            f"{file}: cache entry does not match its key's settings ({array.dtype} "
            f"{array.shape}, metadata {json.dumps(meta)[:300]})"
        )
    return array, meta


def write_entry(file: str, frames: np.ndarray, meta: dict):
    """To a temp file renamed to `file`: readers see the old entry, no entry, or the whole new one
    (the frame cache's, sp.FeatureCache's)."""
    from safetensors.numpy import save_file

    video = json.dumps(meta)
    metadata = {"video": video, "crc32": checksum(file, frames, video)}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), suffix=".tmp")
    os.close(fd)
    try:
        save_file({"frames": frames}, tmp, metadata=metadata)
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_video(
    path: str,
    frames: Frames,
    factor: int = 28,
    cache_dir: str | None = None,
    mode: VideoSource = "prefer_cache",
    stats: dict | None = None,
    end: float | None = None,
) -> tuple[np.ndarray, dict]:
    """Frames uint8 (T, H, W, 3), sampled and resized, and their metadata, through the cache
    (load_entry). end: decode_video's cut, in seconds."""
    decode = functools.partial(decode_video, max_decode_pixels=frames.max_decode_pixels)
    return load_entry(
        path, frames.settings(factor), end, decode, video_fits, cache_dir, mode, stats
    )


def load_entry(
    path: str,
    settings: dict,
    end: float | None,
    decode,
    fits,
    cache_dir: str | None,
    mode: VideoSource,
    stats: dict | None,
) -> tuple[np.ndarray, dict]:
    """decode(path, **settings, end=end) -> (array, metadata), through the cache: the entry of the
    video's identity, the settings and `end` (a clip and its whole video are different entries).
    mode: prefer_cache (read the entry, else decode and write it), cache_only (a missing or bad
    entry is an error; never decodes or writes) or decode_only. An entry that is torn, corrupt,
    edited or not what its key's settings make (`fits`: check_entry) is reported and rebuilt. stats
    counts cache_hit, cache_miss, cache_corrupt, decode and decode_s (added to what it holds)."""
    if choice_error(VideoSource, mode):
        raise UserError(f"video_source/mode: {choice_error(VideoSource, mode)}")
    if stats is None:
        stats = {}
    # also refuses a FIFO or a device, which would block decoding for ever
    if not os.path.isfile(path):
        raise VideoError(f"{path}: video file not found (or not a regular file)")
    if end is not None:
        settings = dict(settings, end=float(end))
    with contextlib.ExitStack() as stack:
        locked = False
        if cache_dir and mode != "decode_only":
            file = entry_path(cache_dir, path, settings)
            # one decode per key: concurrent loaders (ranks, workers) wait here, then hit
            if mode == "prefer_cache":
                try:
                    os.makedirs(os.path.dirname(file), exist_ok=True)
                    fcntl.flock(stack.enter_context(open(file + ".lock", "a")), fcntl.LOCK_EX)
                    locked = True
                except OSError as e:
                    # a read-only or full cache: its entries are still read, misses decoded
                    unwritable(file, e, stats)
            if os.path.exists(file):
                try:
                    out = check_entry(file, settings, fits)
                    count(stats, "cache_hit")
                    return out
                except ValueError as e:
                    count(stats, "cache_corrupt")
                    if mode == "cache_only":
                        raise VideoError(
                            f"{path}: {e} (mode cache_only; rebuild it with "
                            "`python scripts/cache_frames.py`, or audio entries with a prefer_cache run)"
                        ) from e
                    print(f"cache: {e}; rebuilding", file=sys.stderr)
            count(stats, "cache_miss")
            # never decodes, never writes (not even a lock): a read-only shared cache works
            if mode == "cache_only":
                raise VideoError(
                    f"{path}: no cache entry {file} (mode cache_only; run "
                    "`python scripts/cache_frames.py` first, or for audio entries a prefer_cache run)"
                )
        t = time.time()
        out = decode(path, **settings)
        count(stats, "decode")
        count(stats, "decode_s", time.time() - t)
        from safetensors import SafetensorError

        try:
            if locked:  # else unwritable, counted above, or no cache
                write_entry(file, *out)
        # a full disk (safetensors' "No space left on device"), a folder in the entry's place: the
        # frames are kept
        except (OSError, SafetensorError) as e:
            unwritable(file, e, stats)
        return out


def load_audio(
    path: str, media: Media, rate: int, max_s: float, stats: dict | None, end: float | None
) -> np.ndarray:
    """The video's soundtrack (decode_audio) through the cache, as load_video's frames (media's
    cache_dir and video_source). stats also counts audio_clipped (a window over max_s) and
    audio_missing (no audio track: its silence, or under no_audio=error a VideoError naming the
    file)."""
    if stats is None:
        stats = {}
    settings = dict(rate=int(rate), max_s=float(max_s))
    audio, meta = load_entry(
        path, settings, end, decode_audio, audio_fits, media.cache_dir, media.video_source, stats
    )
    count(stats, "audio_clipped", meta["clipped"])
    count(stats, "audio_missing", meta["missing"])
    if meta["missing"] and media.no_audio == "error":
        raise VideoError(f"{path}: no audio track (video_audio; no_audio=silence reads silence)")
    return audio


def count(stats: dict, key: str, amount: float = 1):
    """Adds amount to stats[key] (0 before its first)."""
    stats[key] = stats.get(key, 0) + amount


def unwritable(file: str, e: Exception, stats: dict):
    """An entry that cannot be locked or written: counted in stats["cache_unwritable"], a warning
    the first time (per stats: per run in training), never an error: the frames are used all the
    same."""
    count(stats, "cache_unwritable")
    if stats["cache_unwritable"] == 1:
        print(
            f"warning: cache: cannot lock or write {file} ({type(e).__name__}: {e}): entries it "
            "lacks are decoded, not stored (counted: cache_unwritable)",
            file=sys.stderr,
        )


def load_image(path: str, media: Media, factor: int = 28) -> np.ndarray:
    """uint8 (H, W, 3) smart-resized within media's image pixel budget; over max_decode_pixels:
    refused from the header."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):  # a FIFO or a device would block open() for ever
        raise VideoError(f"{path}: cannot read image (missing, or not a regular file)")
    try:
        with Image.open(path) as im:
            if im.width * im.height > media.max_decode_pixels:
                raise ValueError(
                    f"{im.width}x{im.height} pixels are over "
                    f"max_decode_pixels={media.max_decode_pixels}"
                )
            arr = np.asarray(im.convert("RGB"))
        # refuses a ratio over 200
        h, w = smart_resize(
            arr.shape[0], arr.shape[1], factor, media.image_min_pixels, media.image_max_pixels
        )
    # a bomb: 2x PIL's cap
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError) as e:
        raise VideoError(f"{path}: cannot read image ({type(e).__name__}: {e})") from e
    return resize(arr[None], h, w)[0]

"""cache.py: reference-exact frames, bit-exact cache, key invalidation, atomic writes, corruption.

    .venv/bin/python -m pytest -q tests/test_cache.py
"""
import json
import multiprocessing as mp
import os

import numpy as np
import pytest

import cache
from make_synthetic_data import write_video

SETTINGS = dict(fps=2.0, min_frames=4, max_frames=16, min_pixels=3136, max_pixels=20000, total_pixels=None, factor=28)


@pytest.fixture()
def video(tmp_path):
    """3 s of 100x76 at 10 fps with a moving gradient, so resizing and sampling both matter."""
    t = np.arange(30)[:, None, None, None]
    y, x = np.mgrid[0:76, 0:100]
    frames = ((x[None, ..., None] * 2 + y[None, ..., None] + t * 7 + np.array([0, 60, 120])) % 256).astype(np.uint8)
    path = str(tmp_path / "v.mp4")
    write_video(path, frames, 10)
    return path


def test_matches_qwen_vl_utils(video, monkeypatch):
    monkeypatch.setenv("FORCE_QWENVL_VIDEO_READER", "decord")
    import importlib

    import qwen_vl_utils.vision_process as qv
    importlib.reload(qv)  # the backend choice is read at import time
    (ref, ref_meta), ref_fps = qv.fetch_video({"video": video, "fps": 2.0, "min_frames": 4, "max_frames": 16,
                                               "min_pixels": 3136, "max_pixels": 20000}, image_patch_size=14,
                                              return_video_sample_fps=True, return_video_metadata=True)
    frames, meta = cache.load_video(video, **SETTINGS, mode="decode_only")
    assert meta["frames_indices"] == ref_meta["frames_indices"]
    assert frames.shape == (ref.shape[0], ref.shape[2], ref.shape[3], 3)
    assert meta["sample_fps"] == pytest.approx(ref_fps)
    # qwen-vl-utils resizes the uint8 tensor and then casts to float: the very same values
    assert np.array_equal(frames, ref.permute(0, 2, 3, 1).numpy().astype(np.uint8))
    assert frames.shape[0] % 2 == 0 and frames.shape[1] % 28 == 0 and frames.shape[2] % 28 == 0


def test_cache_is_bit_exact_and_counts(video, tmp_path):
    stats = {}
    a, ma = cache.load_video(video, **SETTINGS, cache_dir=str(tmp_path / "c"), stats=stats)
    b, mb = cache.load_video(video, **SETTINGS, cache_dir=str(tmp_path / "c"), stats=stats)
    c, mc = cache.load_video(video, **SETTINGS, mode="decode_only")
    assert np.array_equal(a, b) and np.array_equal(a, c) and ma == mb == mc
    assert stats["decode"] == 1 and stats["cache_miss"] == 1 and stats["cache_hit"] == 1
    assert a.dtype == np.uint8
    assert set(ma) >= {"fps", "duration", "total_num_frames", "frames_indices", "sample_fps", "height", "width"}


@pytest.mark.parametrize("change", [dict(fps=1.0), dict(min_frames=8), dict(max_frames=8), dict(min_pixels=6272),
                                    dict(max_pixels=40000), dict(total_pixels=50000), dict(factor=32)])
def test_every_setting_is_in_the_key(video, change):
    assert cache.cache_key(video, **SETTINGS) != cache.cache_key(video, **{**SETTINGS, **change})


def test_edited_video_is_a_miss(video, tmp_path):
    d = str(tmp_path / "c")
    cache.load_video(video, **SETTINGS, cache_dir=d)
    write_video(video, np.zeros((30, 76, 100, 3), np.uint8), 10)  # same path, new content
    stats = {}
    frames, _ = cache.load_video(video, **SETTINGS, cache_dir=d, stats=stats)
    assert stats.get("decode") == 1 and frames.max() < 10  # the new (black) content, never the stale entry


def _load(args):
    video, d = args
    return cache.load_video(video, **SETTINGS, cache_dir=d)[0].tobytes()


def test_concurrent_writers_leave_one_valid_entry(video, tmp_path):
    d = str(tmp_path / "c")
    with mp.get_context("spawn").Pool(4) as pool:
        outs = pool.map(_load, [(video, d)] * 8)
    assert len(set(outs)) == 1
    files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
    assert len(files) == 1 and files[0].endswith(".safetensors")  # no temp files left behind
    cache.read_entry(files[0])


def test_truncated_entry_is_detected_and_rebuilt(video, tmp_path, capsys):
    d = str(tmp_path / "c")
    good, _ = cache.load_video(video, **SETTINGS, cache_dir=d)
    (file,) = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(ValueError):
        cache.read_entry(file)
    stats = {}
    again, _ = cache.load_video(video, **SETTINGS, cache_dir=d, stats=stats)
    assert np.array_equal(good, again) and stats["cache_corrupt"] == 1 and stats["decode"] == 1
    assert "rebuilding" in capsys.readouterr().err
    cache.read_entry(file)  # rebuilt in place
    with open(file, "r+b") as f:  # a flipped byte in the frames fails the checksum
        f.seek(-5, 2)
        byte = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match="checksum"):
        cache.read_entry(file)


def test_cache_only_and_bad_videos(video, tmp_path):
    with pytest.raises(cache.VideoError, match="no cache entry"):
        cache.load_video(video, **SETTINGS, cache_dir=str(tmp_path / "empty"), mode="cache_only")
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00 not a video" * 10)
    with pytest.raises(cache.VideoError, match="bad.mp4"):
        cache.load_video(str(bad), **SETTINGS, mode="decode_only")
    with pytest.raises(cache.VideoError, match="not found"):
        cache.load_video(str(tmp_path / "missing.mp4"), **SETTINGS)


def test_preprocess_cli_dedups_and_reports_failures(video, tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"garbage")
    rows = [{"videos": [os.path.basename(video)]}, {"videos": [os.path.basename(video)]}, {"videos": ["bad.mp4"]}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = cache.Config(data=[str(data)], out=str(tmp_path / "c"), workers=2, fps=2.0, min_frames=4, max_frames=16,
                       min_pixels=3136, max_pixels=20000, factor=28)
    s = cache.preprocess(cfg)
    assert s["videos"] == 2 and s["decode"] == 1 and s["failed"] == 1 and s["bytes"] > 0
    failed = [json.loads(line) for line in open(tmp_path / "c" / "failed.jsonl")]
    assert failed[0]["video"].endswith("bad.mp4") and "cannot decode" in failed[0]["error"]
    s2 = cache.preprocess(cfg)  # second run: all hits
    assert s2["cache_hit"] == 1 and s2["decode"] == 0
    frames, _ = cache.load_video(video, **SETTINGS, cache_dir=str(tmp_path / "c"), mode="cache_only")
    assert frames.shape[0] > 0

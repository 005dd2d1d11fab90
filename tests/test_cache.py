"""cache.py: reference-exact frames, bit-exact cache, key invalidation, atomic writes, corruption.

.venv/bin/python -m pytest -q tests/test_cache.py
"""

import dataclasses
import json
import multiprocessing as mp
import os
import re
import zlib

import numpy as np
import pytest

import cache
import cache_frames
from make_synthetic_data import write_video

SETTINGS = dict(
    fps=2.0,
    min_frames=4,
    max_frames=16,
    min_pixels=3136,
    max_pixels=20000,
    total_pixels=None,
    factor=28,
)


def frames_of(settings: dict, **more) -> cache.Frames:
    """The Frames of a settings dict (entry_path's key names; its factor is load_video's own argument)."""
    return cache.Frames(
        **{f"video_{k}": v or 0 for k, v in settings.items() if k != "factor"}, **more
    )


@pytest.fixture()
def video(tmp_path):
    """3 s of 100x76 at 10 fps with a moving gradient, so resizing and sampling both matter."""
    t = np.arange(30)[:, None, None, None]
    y, x = np.mgrid[0:76, 0:100]
    frames = (
        (x[None, ..., None] * 2 + y[None, ..., None] + t * 7 + np.array([0, 60, 120])) % 256
    ).astype(np.uint8)
    path = str(tmp_path / "v.mp4")
    write_video(path, frames, 10)
    return path


REF_CASES = [  # (our settings, qwen-vl-utils' element, image_patch_size): clamps, budgets, up/down-scaling, Qwen3's 32
    (SETTINGS, dict(fps=2.0, min_frames=4, max_frames=16, min_pixels=3136, max_pixels=20000), 14),
    (
        dict(SETTINGS, fps=1.0, min_frames=7, factor=32, max_pixels=8000),
        dict(fps=1.0, min_frames=7, max_frames=16, min_pixels=3136, max_pixels=8000),
        16,
    ),
    (
        dict(SETTINGS, fps=10.0, max_frames=13, total_pixels=40000),
        dict(
            fps=10.0,
            min_frames=4,
            max_frames=13,
            min_pixels=3136,
            max_pixels=20000,
            total_pixels=40000,
        ),
        14,
    ),
    (
        dict(SETTINGS, min_pixels=15000, max_pixels=30000),
        dict(fps=2.0, min_frames=4, max_frames=16, min_pixels=15000, max_pixels=30000),
        14,
    ),
]


@pytest.mark.parametrize("ours,ref_ele,patch", REF_CASES)
def test_matches_qwen_vl_utils(video, monkeypatch, ours, ref_ele, patch):
    monkeypatch.setenv("FORCE_QWENVL_VIDEO_READER", "decord")
    import importlib

    import qwen_vl_utils.vision_process as qv

    importlib.reload(qv)  # the backend choice is read at import time
    (ref, ref_meta), ref_fps = qv.fetch_video(
        {"video": video, **ref_ele},
        image_patch_size=patch,
        return_video_sample_fps=True,
        return_video_metadata=True,
    )
    frames, meta = cache.load_video(video, frames_of(ours), ours["factor"], mode="decode_only")
    assert meta["frames_indices"] == ref_meta["frames_indices"]
    assert frames.shape == (ref.shape[0], ref.shape[2], ref.shape[3], 3)
    assert meta["sample_fps"] == pytest.approx(ref_fps) and meta["fps"] == pytest.approx(
        ref_meta["fps"]
    )
    assert meta["total_num_frames"] == ref_meta["total_num_frames"] == 30
    # qwen-vl-utils resizes the uint8 tensor and then casts to float: the very same values
    assert np.array_equal(frames, ref.permute(0, 2, 3, 1).numpy().astype(np.uint8))
    f = ours["factor"]
    assert frames.shape[0] % 2 == 0 and frames.shape[1] % f == 0 and frames.shape[2] % f == 0


def test_matches_qwen_vl_utils_on_a_long_video(tmp_path, monkeypatch):
    """100 s at 23.976 fps (2398 frames): 200 sampled indices, where the linspace rounding shows."""
    monkeypatch.setenv("FORCE_QWENVL_VIDEO_READER", "decord")
    import importlib

    import qwen_vl_utils.vision_process as qv

    importlib.reload(qv)
    path = str(tmp_path / "long.mp4")
    write_video(path, (np.full((36, 64, 3), i % 256, np.uint8) for i in range(2398)), 23.976)
    ele = dict(fps=2.0, min_frames=4, max_frames=768, min_pixels=3136, max_pixels=3136)
    (ref, ref_meta), _ = qv.fetch_video(
        {"video": path, **ele}, return_video_sample_fps=True, return_video_metadata=True
    )
    frames, meta = cache.load_video(path, frames_of(ele), mode="decode_only")
    assert (
        meta["frames_indices"] == ref_meta["frames_indices"] and len(meta["frames_indices"]) == 200
    )
    assert np.array_equal(frames, ref.permute(0, 2, 3, 1).numpy().astype(np.uint8))


def test_cache_is_bit_exact_and_counts(video, tmp_path):
    stats = {}
    a, ma = cache.load_video(video, frames_of(SETTINGS), cache_dir=str(tmp_path / "c"), stats=stats)
    b, mb = cache.load_video(video, frames_of(SETTINGS), cache_dir=str(tmp_path / "c"), stats=stats)
    c, mc = cache.load_video(video, frames_of(SETTINGS), mode="decode_only")
    assert np.array_equal(a, b) and np.array_equal(a, c) and ma == mb == mc
    assert stats["decode"] == 1 and stats["cache_miss"] == 1 and stats["cache_hit"] == 1
    assert a.dtype == np.uint8
    assert set(ma) >= {
        "fps",
        "duration",
        "total_num_frames",
        "frames_indices",
        "sample_fps",
        "height",
        "width",
    }


def test_end_decodes_the_video_up_to_that_moment(video, tmp_path):
    """end=1.2 s of 3 s at 10 fps: the first 12 frames, sampled as from a file cut there (OVO-Bench's clips); the
    cut is in the entry's key, so the whole video and the clip are different entries."""
    import decord

    clip = str(tmp_path / "clip.mp4")
    write_video(clip, decord.VideoReader(video).get_batch(list(range(12))).asnumpy(), 10)
    want, want_meta = cache.load_video(clip, frames_of(SETTINGS), mode="decode_only")
    stats, c = {}, str(tmp_path / "c")
    got, meta = cache.load_video(video, frames_of(SETTINGS), cache_dir=c, stats=stats, end=1.2)
    assert meta == want_meta and meta["total_num_frames"] == 12 and meta["frames_indices"][-1] == 11
    assert np.abs(got.astype(int) - want).mean() < 2  # the clip is encoded once more
    whole, _ = cache.load_video(video, frames_of(SETTINGS), cache_dir=c, stats=stats)
    again, _ = cache.load_video(video, frames_of(SETTINGS), cache_dir=c, stats=stats, end=1.2)
    assert (
        np.array_equal(got, again)
        and len(whole) > len(got)
        and (stats["cache_miss"], stats["cache_hit"]) == (2, 1)
    )


@pytest.mark.parametrize(
    "change",
    [
        dict(fps=1.0),
        dict(min_frames=8),
        dict(max_frames=8),
        dict(min_pixels=6272),
        dict(max_pixels=40000),
        dict(total_pixels=50000),
        dict(factor=32),
    ],
)
def test_every_setting_is_in_the_key(video, change):
    assert cache.entry_path("c", video, SETTINGS) != cache.entry_path(
        "c", video, {**SETTINGS, **change}
    )


def test_format_path_and_file_identity_are_in_the_key(video, tmp_path, monkeypatch):
    key = cache.entry_path("c", video, SETTINGS)
    assert key == cache.entry_path("c", video, dict(SETTINGS))  # stable
    copy = tmp_path / "copy.mp4"
    copy.write_bytes(open(video, "rb").read())
    os.utime(copy, ns=(os.stat(video).st_atime_ns, os.stat(video).st_mtime_ns))
    assert cache.entry_path("c", str(copy), SETTINGS) != key  # same bytes and mtime, another path
    st = os.stat(video)
    os.utime(
        video, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000)
    )  # touched: same size, new mtime
    assert cache.entry_path("c", video, SETTINGS) != key
    touched = cache.entry_path("c", video, SETTINGS)
    monkeypatch.setattr(cache, "FORMAT", cache.FORMAT + "-next")
    assert cache.entry_path("c", video, SETTINGS) != touched


def test_edited_video_is_a_miss(video, tmp_path):
    d = str(tmp_path / "c")
    cache.load_video(video, frames_of(SETTINGS), cache_dir=d)
    write_video(video, np.zeros((30, 76, 100, 3), np.uint8), 10)  # same path, new content
    stats = {}
    frames, _ = cache.load_video(video, frames_of(SETTINGS), cache_dir=d, stats=stats)
    assert (
        stats.get("decode") == 1 and frames.max() < 10
    )  # the new (black) content, never the stale entry


def _load(args):
    video, d = args
    stats = {}
    return cache.load_video(video, frames_of(SETTINGS), cache_dir=d, stats=stats)[
        0
    ].tobytes(), stats


def entries(d):
    return sorted(
        os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if not f.endswith(".lock")
    )


def test_concurrent_loaders_decode_once_and_leave_one_valid_entry(video, tmp_path):
    d = str(tmp_path / "c")
    with mp.get_context("spawn").Pool(4) as pool:
        outs = pool.map(_load, [(video, d)] * 8, chunksize=1)
    assert len({o for o, _ in outs}) == 1
    # the per-key lock: one process decodes, the seven other loads wait and hit
    assert (
        sum(s.get("decode", 0) for _, s in outs) == 1
        and sum(s.get("cache_hit", 0) for _, s in outs) == 7
    )
    (file,) = entries(d)  # no temp files left behind
    assert file.endswith(".safetensors") and cache.read_entry(file)[0].tobytes() == outs[0][0]


def _write_many(args):
    file, value = args
    for _ in range(40):
        cache.write_entry(file, np.full((8, 224, 224, 3), value, np.uint8), {"value": value})


def test_concurrent_writers_never_expose_a_torn_entry(tmp_path):
    """Writers racing on one file (no lock): every read during the writes sees one whole entry, one valid entry
    stays, no temp file is left. (In-place writes rarely tear visibly here: the window is microseconds.)"""
    file = str(tmp_path / "e.safetensors")
    cache.write_entry(file, np.full((4, 56, 56, 3), 0, np.uint8), {"value": 0})
    with mp.get_context("spawn").Pool(3) as pool:
        job = pool.map_async(_write_many, [(file, v) for v in (1, 2, 3)])
        while not job.ready():
            frames, meta = cache.read_entry(file)  # raises on a torn entry
            assert (frames == meta["value"]).all()
        job.get()
    assert entries(tmp_path) == [file] and cache.read_entry(file)[1]["value"] in (1, 2, 3)


def test_truncated_entry_is_detected_and_rebuilt(video, tmp_path, capsys):
    d = str(tmp_path / "c")
    good, _ = cache.load_video(video, frames_of(SETTINGS), cache_dir=d)
    (file,) = entries(d)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(ValueError):
        cache.read_entry(file)
    stats = {}
    again, _ = cache.load_video(video, frames_of(SETTINGS), cache_dir=d, stats=stats)
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
        cache.load_video(
            video, frames_of(SETTINGS), cache_dir=str(tmp_path / "empty"), mode="cache_only"
        )
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00 not a video" * 10)
    with pytest.raises(cache.VideoError, match="bad.mp4"):
        cache.load_video(str(bad), frames_of(SETTINGS), mode="decode_only")
    with pytest.raises(cache.VideoError, match="not found"):
        cache.load_video(str(tmp_path / "missing.mp4"), frames_of(SETTINGS))


def rows(*videos) -> str:
    """JSONL with one multiple-choice sample per video."""
    sample = {"problem": "q", "answer": "A", "problem_type": "multiple choice"}
    return "".join(json.dumps(dict(sample, videos=[v])) + "\n" for v in videos)


def test_preprocess_cli_dedups_and_reports_failures(video, tmp_path):
    """The real command: two data files, one video listed 3 times under 2 spellings, a corrupt and a missing one."""
    import shutil
    import subprocess
    import sys
    from conftest import ROOT

    os.makedirs(tmp_path / "videos")
    shutil.copy(video, tmp_path / "videos" / "b.mp4")
    (tmp_path / "videos" / "bad.mp4").write_bytes(b"garbage")
    (tmp_path / "train.jsonl").write_text(
        rows("v.mp4", "videos/bad.mp4", "./v.mp4", "videos/b.mp4")
    )
    (tmp_path / "val.jsonl").write_text(rows(video, "videos/missing.mp4"))
    out = tmp_path / "c"
    cmd = [
        sys.executable,
        "scripts/cache_frames.py",
        "--data",
        str(tmp_path / "train.jsonl"),
        "--data",
        str(tmp_path / "val.jsonl"),
        "--out",
        str(out),
        "--workers",
        "2",
        "--video-fps",
        "2",
        "--video-min-frames",
        "4",
        "--video-max-frames",
        "16",
        "--video-min-pixels",
        "3136",
        "--video-max-pixels",
        "20000",
        "--factor",
        "28",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "videos: 100%" in p.stderr  # the progress bar
    summary = p.stdout.splitlines()[0]
    assert summary.startswith("videos 4 | cache_hit 0 | rebuilt 0 | decode 2 | failed 2 | bytes ")
    assert "| seconds " in summary
    nbytes = int(summary.split("bytes ")[1].split()[0])
    assert nbytes == sum(os.path.getsize(f) for f in entries(out) if f.endswith(".safetensors")) > 0
    failed = {
        os.path.basename(x["video"]): x["error"]
        for x in map(json.loads, open(out / "failed.jsonl"))
    }
    assert set(failed) == {"bad.mp4", "missing.mp4"} and "cannot decode" in failed["bad.mp4"]
    assert "not found" in failed["missing.mp4"] and "failed.jsonl" in p.stdout
    cfg = cache_frames.Config(
        data=[str(tmp_path / "train.jsonl")],
        out=str(out),
        workers=1,
        video_fps=2.0,
        video_min_frames=4,
        video_max_frames=16,
        video_min_pixels=3136,
        video_max_pixels=20000,
        factor=28,
    )
    s = cache_frames.preprocess(cfg)  # second run: hits only, same settings as train.py would pass
    assert (s["videos"], s["cache_hit"], s["decode"], s["failed"]) == (3, 2, 0, 1)
    frames, _ = cache.load_video(video, frames_of(SETTINGS), cache_dir=str(out), mode="cache_only")
    assert np.array_equal(
        frames, cache.load_video(video, frames_of(SETTINGS), mode="decode_only")[0]
    )


def edit_header(file, edit):
    """Rewrite a safetensors file's JSON header with edit(header), keeping the data bytes: a header that lies."""
    raw = open(file, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    open(file, "wb").write(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def set_dtype_f32(
    header,
):  # the same bytes read as float32 (T, H, W / 4, 3): the crc over the bytes still holds
    header["frames"]["dtype"] = "F32"
    header["frames"]["shape"][2] //= 4


def set_shape_twice_as_many(header):  # the same bytes read as (2T, H / 2, W, 3)
    header["frames"]["shape"][0] *= 2
    header["frames"]["shape"][1] //= 2


def set_fps_in_place(header):  # metadata edited in the file, crc left as it was
    header["__metadata__"]["video"] = header["__metadata__"]["video"].replace(
        '"fps": 10.0', '"fps": 1000000000.0'
    )


def test_tampered_entries_are_reported_and_rebuilt_by_the_cli(video, tmp_path):
    """The real command on a cache whose entries lie (header dtype/shape, float frames, fps 1e9, indices, `video` a
    list, no `video`, an in-place metadata edit, another key's entry): each one is reported and rebuilt, never served
    (before: served as hits, or a KeyError); under cache_only each is an error naming the video."""
    import shutil
    import subprocess
    import sys
    from conftest import ROOT
    from safetensors.numpy import save_file

    names = [
        "dtype",
        "shape",
        "float",
        "fps",
        "indices",
        "list",
        "no_video",
        "in_place",
        "copied",
        "intact",
    ]
    for name in names:
        shutil.copy(video, tmp_path / f"{name}.mp4")
    (tmp_path / "train.jsonl").write_text(rows(*(f"{n}.mp4" for n in names)))
    out = tmp_path / "c"
    cmd = [
        sys.executable,
        "scripts/cache_frames.py",
        "--data",
        str(tmp_path / "train.jsonl"),
        "--out",
        str(out),
        "--workers",
        "2",
        "--video-fps",
        "2",
        "--video-min-frames",
        "4",
        "--video-max-frames",
        "16",
        "--video-min-pixels",
        "3136",
        "--video-max-pixels",
        "20000",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.stdout.startswith("videos 10 | cache_hit 0 | rebuilt 0 | decode 10 | failed 0 |"), (
        p.stderr[-3000:]
    )
    good, meta = cache.load_video(video, frames_of(SETTINGS), mode="decode_only")
    file = {
        n: cache.entry_path(str(out), str(tmp_path / f"{n}.mp4"), dict(SETTINGS, total_pixels=0))
        for n in names
    }
    edit_header(file["dtype"], set_dtype_f32)
    edit_header(file["shape"], set_shape_twice_as_many)
    edit_header(file["in_place"], set_fps_in_place)
    cache.write_entry(file["float"], good.astype(np.float32), meta)
    cache.write_entry(file["fps"], good, dict(meta, fps=1e9))
    cache.write_entry(
        file["indices"], good, dict(meta, frames_indices=meta["frames_indices"][::-1])
    )
    cache.write_entry(file["list"], good, [meta])
    save_file(
        {"frames": good}, file["no_video"], metadata={"crc32": str(zlib.crc32(good.tobytes()))}
    )  # v2 crc
    shutil.copy(file["intact"], file["copied"])
    for name in names[:-1]:
        with pytest.raises(cache.VideoError, match=f"{name}.mp4: .*cache entry.*mode cache_only"):
            cache.load_video(
                str(tmp_path / f"{name}.mp4"),
                frames_of(SETTINGS),
                cache_dir=str(out),
                mode="cache_only",
            )
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.stdout.startswith("videos 10 | cache_hit 1 | rebuilt 9 | decode 9 | failed 0 |"), (
        p.stderr[-3000:]
    )
    reports = re.findall(
        r"cache: (.*?); rebuilding", p.stderr
    )  # tqdm's \r-lines may share a line with a report
    assert sorted(next(n for n in names if file[n] in r) for r in reports) == sorted(names[:-1])
    for name in names:  # rebuilt in place: every entry is now served, with the decoded frames
        frames, m = cache.load_video(
            str(tmp_path / f"{name}.mp4"),
            frames_of(SETTINGS),
            cache_dir=str(out),
            mode="cache_only",
        )
        assert np.array_equal(frames, good) and m == meta


def test_frames_over_the_pixel_limit_are_refused_before_decoding(video, tmp_path):
    """A 100x76 clip under max_decode_pixels=100*75: refused from its header (no frame decoded), naming the file and
    the size; at 100*76 it decodes to the same frames as without a limit."""
    with pytest.raises(
        cache.VideoError, match=r"v.mp4: frames of 100x76 are over max_decode_pixels=7500"
    ):
        cache.load_video(video, frames_of(SETTINGS, max_decode_pixels=100 * 75), mode="decode_only")
    frames, _ = cache.load_video(
        video, frames_of(SETTINGS, max_decode_pixels=100 * 76), mode="decode_only"
    )
    assert np.array_equal(
        frames, cache.load_video(video, frames_of(SETTINGS), mode="decode_only")[0]
    )


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_media_paths_that_are_not_regular_files_fail_at_once(tmp_path, kind):
    """A FIFO (nobody writes to it) or a character device as an image or a video: a media error, not a hang."""
    path = str(tmp_path / "fifo.png")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path = "/dev/zero"
    with pytest.raises(cache.VideoError, match=f"{path}: cannot read image .*not a regular file"):
        cache.load_image(path, cache.Media(image_max_pixels=20000))
    with pytest.raises(
        cache.VideoError, match=f"{path}: video file not found .*not a regular file"
    ):
        cache.load_video(path, frames_of(SETTINGS), mode="decode_only")


def read_only(folder) -> bool:
    """Makes the tree read-only (folders 0o555, files 0o444); False where that does not stop writes
    (root)."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for f in files:
            os.chmod(os.path.join(root, f), 0o444)
        os.chmod(root, 0o555)
    try:
        open(os.path.join(folder, "probe"), "w").close()
    except PermissionError:
        return True
    os.remove(os.path.join(folder, "probe"))
    return False


def test_unwritable_entries_keep_their_frames(video, tmp_path, monkeypatch, capsys):
    """Issue 44 item 9: an entry that cannot be locked or written is a miss that returns the decoded
    frames, counted (cache_unwritable) with one warning; a readable entry is still a hit. A folder
    in the entry's place (before: a raw IsADirectoryError on rebuild), a full disk (before:
    safetensors' error, the decode lost), a read-only cache (before: its lock file failed, even on a
    hit)."""
    from safetensors import SafetensorError
    import safetensors.numpy

    def load(d, settings=SETTINGS) -> dict:
        """load_video's stats; its frames must be the decoded ones."""
        stats = {}
        got, _ = cache.load_video(video, frames_of(settings), cache_dir=str(d), stats=stats)
        assert np.array_equal(
            got, cache.load_video(video, frames_of(settings), mode="decode_only")[0]
        )
        return stats

    folder = tmp_path / "folder"
    os.makedirs(cache.entry_path(str(folder), video, frames_of(SETTINGS).settings(28)))
    stats = load(folder)
    assert (stats["cache_corrupt"], stats["decode"], stats["cache_unwritable"]) == (1, 1, 1)
    assert "IsADirectoryError" in capsys.readouterr().err

    def full(*args, **kwargs):  # what a full disk raises (measured on a 64 KiB tmpfs)
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    stats = load(tmp_path / "full")
    assert (stats["decode"], stats["cache_unwritable"]) == (1, 1) and entries(
        tmp_path / "full"
    ) == []
    assert capsys.readouterr().err.count("No space left on device") == 1
    monkeypatch.undo()

    ro = tmp_path / "ro"
    load(ro)
    other = ro  # a miss there: its shard folder cannot be made
    if not read_only(ro):  # root writes anyway: its lock file a folder, a cache under a file
        (shard,) = [ro / f for f in os.listdir(ro)]
        os.chmod(shard, 0o755)
        for lock in shard.glob("*.lock"):
            lock.unlink()
            lock.mkdir()
        (tmp_path / "file").touch()
        other = tmp_path / "file" / "c"
    stats = load(ro)
    assert (stats["cache_hit"], stats.get("decode", 0), stats["cache_unwritable"]) == (1, 0, 1)
    stats = load(other, dict(SETTINGS, max_frames=8))
    assert (stats["decode"], stats["cache_unwritable"]) == (1, 1)
    for root, dirs, files in os.walk(ro):
        os.chmod(root, 0o755)  # pytest can delete it


def test_a_one_token_budget_keeps_both_sides():
    """qwen-vl-utils floors a 16:9 frame under 784 pixels to height 0; the processor's rule keeps a
    side at one factor at least, so a 720p clip decodes under long_video_cpu.yaml's budget."""
    assert cache.smart_resize(720, 1280, 28, 784, 784) == (28, 28)
    assert cache.smart_resize(1280, 720, 32, 1024, 1024) == (32, 32)
    assert cache.smart_resize(480, 640, 28, 3136, 3136) == (28, 56)  # unchanged where no side is 0


# ---- the soundtrack (issue 45: Omni thinkers, use_audio_in_video) -------------------------------------------


def tone_video(path, hz: float, seconds: float, fps: float = 2) -> str:
    """A gray clip whose soundtrack (16 kHz mono AAC) is a sine of `hz`."""
    write_video(str(path), np.full((round(seconds * fps), 32, 32, 3), 90, np.uint8), fps, tone=hz)
    return str(path)


def peak_hz(audio: np.ndarray, rate: int = 16000) -> float:
    return float(np.abs(np.fft.rfft(audio)).argmax() * rate / len(audio))


def test_omni_audio_decode_hears_the_tone(tmp_path):
    """Real audio: the tone's frequency comes back from an FFT of the decoded waveform, mono float32 at 16 kHz, also
    from a 44.1 kHz stereo track (resampled, downmixed); a clip's samples are the first ones of the whole track's."""
    import av

    media = cache.Media(video_source="decode_only")
    audio = cache.load_audio(tone_video(tmp_path / "a.mp4", 440, 2), media, 16000, 30, None, None)
    assert audio.dtype == np.float32 and audio.shape == (32000,) and abs(peak_hz(audio) - 440) < 2
    assert (
        0.15 < np.abs(audio).max() < 0.35
    )  # the written amplitude is 0.25: AAC is lossy, not silent
    path = str(tmp_path / "stereo.mp4")
    with av.open(path, "w", format="mp4") as f:
        v = f.add_stream("libx264", rate=2)
        v.width = v.height = 32
        v.pix_fmt = "yuv420p"
        a = f.add_stream("aac", rate=44100, layout="stereo")
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            frame.pts = i
            f.mux(v.encode(frame))
        f.mux(v.encode())
        left = 0.3 * np.sin(2 * np.pi * 300 * np.arange(88200) / 44100)
        frame = av.AudioFrame.from_ndarray(
            np.stack([left, np.zeros_like(left)]), format="dblp", layout="stereo"
        )
        frame.sample_rate = 44100
        frame.pts = 0
        f.mux(a.encode(frame))
        f.mux(a.encode())
    whole = cache.load_audio(path, media, 16000, 30, None, None)
    clip = cache.load_audio(path, media, 16000, 30, None, 1.0)
    assert whole.shape == (32000,) and abs(peak_hz(whole) - 300) < 2
    assert clip.shape == (16000,) and np.array_equal(clip, whole[:16000])


def test_omni_audio_window_is_the_frames_and_clips_count(tmp_path):
    """A 10 s video cut at video_end=4: its frames span 4 s and its audio is their window, round(4 * 16000) =
    64,000 samples, the whole track's first ones; max_s bounds the window (counted: audio_clipped), an end past the
    video is the video's end."""
    path = tone_video(tmp_path / "long.mp4", 800, 10)
    media = cache.Media(video_source="decode_only")
    stats = {}
    whole = cache.load_audio(path, media, 16000, 30, stats, None)
    clip = cache.load_audio(path, media, 16000, 30, stats, 4)
    _, meta = cache.load_video(path, media, mode="decode_only", end=4)
    assert meta["duration"] == 4.0 and clip.shape == (64000,) and whole.shape == (160000,)
    assert np.array_equal(clip, whole[:64000]) and stats["audio_clipped"] == 0
    assert cache.load_audio(path, media, 16000, 3, stats, 4).shape == (48000,)
    assert cache.load_audio(path, media, 16000, 30, stats, 25.0).shape == (160000,)
    assert stats["audio_clipped"] == 1 and stats["decode"] == 4


def test_omni_audio_missing_track_silence_or_error(video, tmp_path):
    """A video without an audio track: silence over its window (3 s: 48,000 zeros) under no_audio=silence, a
    VideoError naming the file under no_audio=error, counted either way, from a decode and from a cache hit."""
    silence = cache.Media(cache_dir=str(tmp_path / "c"), no_audio="silence")
    stats = {}
    audio = cache.load_audio(video, silence, 16000, 30, stats, None)
    assert audio.shape == (48000,) and audio.dtype == np.float32 and not audio.any()
    assert cache.load_audio(video, silence, 16000, 30, stats, 1.5).shape == (24000,)
    error = cache.Media(cache_dir=str(tmp_path / "c"), no_audio="error")
    with pytest.raises(cache.VideoError, match=r"v\.mp4: no audio track"):
        cache.load_audio(video, error, 16000, 30, stats, None)  # a hit
    with pytest.raises(cache.VideoError, match=r"v\.mp4: no audio track"):
        cache.load_audio(video, dataclasses.replace(error, cache_dir=""), 16000, 30, stats, None)
    assert stats["audio_missing"] == 4 and (stats["cache_hit"], stats["decode"]) == (1, 3)
    from common import field_errors

    assert field_errors(cache.Media(no_audio="mute")) == [
        "no_audio: 'mute' is not 'silence' | 'error'"
    ]


def test_omni_audio_cache_roundtrip(tmp_path):
    """The frame cache's entries, checks and modes: a hit is the decode bit for bit; the rate, max_s and end are in
    the key, apart from the frames' entry; a truncated or tampered entry is rebuilt; cache_only never decodes."""
    path = tone_video(tmp_path / "t.mp4", 400, 3)
    media = cache.Media(cache_dir=str(tmp_path / "c"))
    stats = {}
    first = cache.load_audio(path, media, 16000, 30, stats, None)
    again = cache.load_audio(path, media, 16000, 30, stats, None)
    ref = cache.load_audio(path, cache.Media(video_source="decode_only"), 16000, 30, None, None)
    assert (
        np.array_equal(first, again)
        and np.array_equal(first, ref)
        and first.tobytes() == ref.tobytes()
    )
    assert (stats["cache_miss"], stats["cache_hit"], stats["decode"]) == (1, 1, 1)
    cache.load_audio(path, media, 8000, 30, stats, None)
    cache.load_audio(path, media, 16000, 2, stats, None)
    cache.load_audio(path, media, 16000, 30, stats, 2)
    cache.load_video(path, media, cache_dir=media.cache_dir, stats=stats)
    assert stats["cache_miss"] == 5 and len(entries(media.cache_dir)) == 5
    file = cache.entry_path(media.cache_dir, path, dict(rate=16000, max_s=30.0))
    assert cache.read_entry(file)[0].tobytes() == ref.tobytes()
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    stats = {}
    assert np.array_equal(cache.load_audio(path, media, 16000, 30, stats, None), ref)
    assert (stats["cache_corrupt"], stats["decode"]) == (1, 1)
    cache.write_entry(file, ref.astype(np.float64), dict(clipped=False, missing=False))
    cache.load_audio(path, media, 16000, 30, stats, None)
    cache.write_entry(file, ref, dict(clipped=False))
    cache.load_audio(path, media, 16000, 30, stats, None)
    assert (stats["cache_corrupt"], stats["decode"]) == (3, 3) and cache.read_entry(file)[
        1
    ] == dict(clipped=False, missing=False)
    only = dataclasses.replace(media, cache_dir=str(tmp_path / "empty"), video_source="cache_only")
    with pytest.raises(cache.VideoError, match="t.mp4: no cache entry"):
        cache.load_audio(path, only, 16000, 30, stats, None)
    assert not os.path.exists(only.cache_dir)

"""Decode every video of the data files once into the frame cache (cache.py), ahead of a run (README "Frame cache"):

    python scripts/cache_frames.py --config configs/qwen2_5_vl_7b.yaml --workers 16
    python scripts/cache_frames.py --data train.jsonl --out .cache/frames --workers 2 --video-fps 2 --factor 28

prints `videos | cache_hit | rebuilt | decode | failed | bytes | seconds` and lists failed videos in OUT/failed.jsonl.
`--config train.yaml` (read as train.py reads it) sets the data files, cache folder, frame settings and the model's
factor, so the cache cannot drift from training; flags override them.
"""

import json
import os
import time
from dataclasses import dataclass, field, fields

import repo  # noqa: F401  (puts the project root on sys.path)
from cache import Frames, Media, VideoError, entry_path, load_video, vision_factor
from common import (
    UserError,
    check_hub,
    cli,
    config_files,
    write_jsonl,
    yaml_overlay,
)


@dataclass
class Config(Frames):
    config: tuple[str, ...] = ()
    """training YAMLs (train.py's --config, read alike): their train_data, val_data, cache_dir, video_* settings and
    model's factor set the defaults, so the cache cannot drift from training; flags override them"""
    data: list[str] = field(default_factory=list)
    """JSON/JSONL files whose `videos` to preprocess (paths relative to each file's folder)"""
    out: str = ".cache/frames"
    """cache folder (train.py's --cache-dir)"""
    workers: int = 2
    """decoding processes"""
    factor: int = 28
    """patch x merge: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL"""


def preprocess_one(path: str, c: Config) -> dict:
    """This video's load_video stats and entry bytes, or its error: returned to be reported, never raised."""
    stats = {}
    try:
        load_video(path, c, c.factor, cache_dir=c.out, stats=stats)
        if stats.get("cache_unwritable"):
            return stats | {"error": f"{path}: decoded, but its cache entry cannot be written"}
        return stats | {"bytes": os.path.getsize(entry_path(c.out, path, c.settings(c.factor)))}
    except Exception as e:  # noqa: BLE001  listed in failed.jsonl and counted: one bad video never stops the run
        return stats | {
            "error": str(e) if isinstance(e, VideoError) else f"{type(e).__name__}: {e}"
        }


def videos_of(path: str) -> list[str]:
    """The absolute paths of the videos a JSON/JSONL data file names (relative to its folder); the samples' other
    fields are data.py's to check. A file that is not a list of such samples is an error naming it."""
    try:
        with open(path, "rb") as f:
            if path.endswith(".json"):
                rows = json.load(f)
            else:
                rows = [json.loads(line) for line in f if line.strip()]
        root = os.path.dirname(os.path.abspath(path))
        return [os.path.abspath(os.path.join(root, v)) for s in rows for v in s.get("videos", [])]
    except (ValueError, AttributeError, TypeError) as e:
        raise UserError(
            f"{path}: not a list of samples naming their videos ({type(e).__name__}: {e})"
        ) from e


def preprocess(c: Config) -> dict:
    """Decode each distinct video of the data files once into the cache; failures go to OUT/failed.jsonl."""
    from collections import Counter
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm import tqdm

    # each distinct video once, in order
    videos = list(dict.fromkeys(v for path in c.data for v in videos_of(path)))
    t = time.time()
    total = Counter()
    failed = []
    with ProcessPoolExecutor(c.workers) as ex:
        jobs = {ex.submit(preprocess_one, v, c): v for v in videos}
        for job in tqdm(as_completed(jobs), total=len(jobs), desc="videos", unit="video"):
            stats = job.result()
            if "error" in stats:
                failed.append({"video": jobs[job], "error": stats.pop("error")})
            total.update(stats)
    # rewritten each run: it lists this run's failures
    write_jsonl(os.path.join(c.out, "failed.jsonl"), sorted(failed, key=lambda x: x["video"]))
    return dict(
        videos=len(videos),
        cache_hit=total["cache_hit"],
        rebuilt=total["cache_corrupt"],
        decode=total["decode"],
        failed=len(failed),
        bytes=total["bytes"],
        seconds=round(time.time() - t, 2),
    )


def load_config(argv: list[str]) -> Config:
    """The CLI: `--config train.yaml ...` (read as train.py reads it) sets the defaults from training's settings
    (training_defaults); the other flags override them."""
    import tyro

    paths, argv = config_files(argv)
    default = Config()
    if paths:
        default = training_defaults(paths)
    # --data a --data b
    return tyro.cli(Config, default=default, args=argv, config=(tyro.conf.UseAppendAction,))


def training_defaults(paths: list[str]) -> Config:
    """What training YAMLs (each file over the ones before) say of the frames: their frame settings and cache_dir,
    train_data, val_data (only when the held-out frame budget is training's: no val_* key says otherwise) and the
    factor of their model. Their other keys are train.py's (train.Config declares them all)."""
    import yaml

    media = Media()
    run = {}
    for path in paths:
        media = yaml_overlay(media, path, strict=False)  # the frame settings, typed
        with open(path) as f:
            run.update(yaml.safe_load(f) or {})
    # a val_* frame setting unlike training's: val_data is sampled otherwise, not cached here
    own_budget = any(
        getattr(media, k[4:], None) != v
        for k, v in run.items()
        if k.startswith("val_") and k != "val_data" and v
    )
    files = []
    if run.get("train_data"):
        files.append(run["train_data"])
    if run.get("val_data") and not own_budget:
        files.append(run["val_data"])
    for path in files:  # before the processor loads
        if not isinstance(path, str) or not os.path.isfile(path):
            raise UserError(f"{path}: no such file (train_data or val_data of {' '.join(paths)})")
    factor = Config.factor
    if run.get("model"):
        check_hub(run["model"])
        from transformers import AutoProcessor

        trust = run.get("trust_remote_code") is True
        factor = vision_factor(AutoProcessor.from_pretrained(run["model"], trust_remote_code=trust))
    frames = {f.name: getattr(media, f.name) for f in fields(Frames)}
    return Config(config=tuple(paths), data=files, out=media.cache_dir, factor=factor, **frames)


def main(c: Config):
    if not c.data:
        raise UserError("no data files: give --data FILE (repeatable) or --config train.yaml")
    summary = preprocess(c)
    print(" | ".join(f"{k} {v}" for k, v in summary.items()))
    if summary["failed"]:
        print(f"{summary['failed']} failed videos listed in {os.path.join(c.out, 'failed.jsonl')}")


if __name__ == "__main__":
    cli(main, load_config)

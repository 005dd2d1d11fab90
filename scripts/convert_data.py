"""Convert a public video-RL training set into our JSONL (README "Real data": where to get it, what maps to what).

    python scripts/convert_data.py --source video-r1 --src Video-R1-data/Video-R1-260k.json --out data/train.jsonl

Sources (sample records: tests/fixtures/convert/): video-r1, Video-R1-260k.json or Video-R1-COT-165k.json (a JSON
array; the CoT file's `process` + `solution` is its SFT target); easyvideor1, EasyVideoR1's training JSON/JSONL;
longvideo-reason, LongVideo-Reason's records (NVlabs/Long-RL: `videos` one path, `problem`, `answer`
<answer>X</answer>, problem_type "general", `reasoning` the CoT). --offline-output writes the CoT as offline_output:
train.py's SFT target (--loss-type sft) or mixed offline-online trajectory (--mix-offline). Every written record
passes data.validate_sample; one that cannot be mapped goes to OUT.skipped.jsonl as {index, problem_id, reason,
detail}, counted in OUT.report.json.
"""

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import repo  # noqa: F401  (puts the project root on sys.path)
import data
import rewards
from common import write_text


@dataclass
class Config:
    source: Literal["video-r1", "easyvideor1", "longvideo-reason"]
    """which release `src` is (field names differ, see the module docstring)"""
    src: str
    """the source file: a JSON array, or JSONL (one object per line)"""
    out: str = "data/train.jsonl"
    """the JSONL to write; OUT.skipped.jsonl and OUT.report.json go beside it"""
    media_root: str = ""
    """folder that relative media paths are below ('' = the source file's folder)"""
    offline_output: bool = False
    """copy curated reasoning into offline_output: Video-R1's `process` + its answer, LongVideo-Reason's
    `reasoning` in <think> tags + its answer, EasyVideoR1's `offline_output` where has_offline_trajectory is true"""
    check_media: bool = True
    """skip (and report) records whose media file does not exist under media_root"""


class Unmapped(ValueError):
    """A record we cannot convert; args: (reason, the short category counted in the report; detail)."""


def bare_answer(value) -> str:
    """Our ground truth: without <answer> tags; a number or a grounding object becomes its JSON text."""
    return rewards.ground_truth({"answer": value if isinstance(value, str) else json.dumps(value)})


def from_video_r1(r: dict, use_offline: bool) -> dict:
    if r["data_type"] not in ("video", "image"):
        raise Unmapped("unknown data_type", repr(r["data_type"]))
    out = dict(
        problem=r["problem"],
        answer=bare_answer(r["solution"]),
        problem_type=r["problem_type"],
        data_type=r["data_type"],
        options=r.get("options") or [],
        **{r["data_type"] + "s": [r["path"]]},
    )
    if use_offline and r.get("process"):  # Video-R1's SFT target is process + "\n" + solution
        out["offline_output"] = f"{r['process'].strip()}\n<answer>{out['answer']}</answer>"
    return out


def from_easyvideor1(r: dict, use_offline: bool) -> dict:
    out = dict(
        problem=r["problem"], answer=bare_answer(r["answer"]), problem_type=r["problem_type"]
    )
    out |= {k: r[k] for k in ("data_type", "options", "videos", "images") if k in r}
    if use_offline and r.get("has_offline_trajectory") and r.get("offline_output"):
        out["offline_output"] = r["offline_output"]
    return out


def from_longvideo_reason(r: dict, use_offline: bool) -> dict:
    """Its problem_type is "general" (a letter answer: multiple choice, options in the problem's
    text; else open-ended) and its videos one path."""
    answer = bare_answer(r["answer"])
    ptype = "open-ended"
    if re.fullmatch("[A-Z]", answer):
        ptype = "multiple choice"
    videos = r["videos"]
    if isinstance(videos, str):
        videos = [videos]
    out = dict(problem=r["problem"], answer=answer, problem_type=ptype, videos=videos)
    if use_offline and r.get("reasoning"):
        think = r["reasoning"].strip()
        if not think.startswith("<think>"):
            think = f"<think>{think}</think>"
        out["offline_output"] = f"{think}\n<answer>{answer}</answer>"
    return out


FROM = {
    "video-r1": from_video_r1,
    "easyvideor1": from_easyvideor1,
    "longvideo-reason": from_longvideo_reason,
}


def convert(r, index: int, c: Config, media_root: str) -> dict:
    """One source record -> one validated sample in our schema, or Unmapped."""
    if not isinstance(r, dict):
        raise Unmapped("not a JSON object", type(r).__name__)
    try:
        s = FROM[c.source](r, c.offline_output)
    except KeyError as e:
        raise Unmapped(f"missing field {e}", f"the record has {sorted(r)}") from None
    ptype = rewards.canonical_type(s["problem_type"])
    # e.g. EasyVideoR1's llava/critic/html-code: no reward of ours scores them
    if ptype not in rewards.ACCURACY:
        raise Unmapped(
            f"no reward for problem_type {s['problem_type']!r}", f"ours: {sorted(rewards.ACCURACY)}"
        )
    s = {"id": f"{c.source}-{index}", **s, "problem_type": ptype}
    s |= {
        k: r[k] for k in ("problem_id", "data_source") if k in r
    }  # kept for tracing back to the source
    out_dir = os.path.dirname(os.path.abspath(c.out))
    for key in ("videos", "images"):
        paths = s.get(key, [])
        if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            raise Unmapped(
                f"{key} not a list of file paths", repr(paths)[:200]
            )  # e.g. inline image bytes
        files = [os.path.normpath(os.path.join(media_root, p)) for p in paths]
        missing = [f for f in files if c.check_media and not os.path.exists(f)]
        if missing:
            raise Unmapped("media file missing", missing[0])
        s[key] = [os.path.relpath(f, out_dir) for f in files]
    s = {k: v for k, v in s.items() if v != []}  # no videos, images or options: leave the field out
    try:
        data.validate_sample(s, f"{c.out}:{index}")
    except data.DataError as e:
        field = re.search(r"field '(\w+)'", str(e))
        raise Unmapped(
            f"invalid {field.group(0) if field else 'record'}", str(e).split(": ", 1)[1]
        ) from None
    return s


def main(c: Config) -> dict:
    media_root = c.media_root or os.path.dirname(os.path.abspath(c.src))
    stem = c.out.removesuffix(".jsonl")
    with open(c.src, encoding="utf-8") as f:
        records = list(f) if c.src.endswith(".jsonl") else json.load(f)
    written = []
    skipped = []
    for index, r in enumerate(records):
        if isinstance(r, str) and not r.strip():
            continue  # a blank JSONL line holds no record
        try:
            r = json.loads(r) if isinstance(r, str) else r  # a JSONL line
            written.append(convert(r, index, c, media_root))
        except json.JSONDecodeError as e:
            skipped.append(
                dict(index=index, problem_id=None, reason="malformed JSON", detail=e.msg)
            )
        except Unmapped as e:
            source_id = r.get("problem_id") if isinstance(r, dict) else None
            skipped.append(
                dict(index=index, problem_id=source_id, reason=e.args[0], detail=e.args[1])
            )
    for path, rows in ((c.out, written), (stem + ".skipped.jsonl", skipped)):
        write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    report = dict(
        source=c.source,
        src=c.src,
        out=c.out,
        converted=len(written),
        skipped=len(skipped),
        offline_output=sum("offline_output" in s for s in written),
        reasons=dict(Counter(s["reason"] for s in skipped).most_common()),
    )
    write_text(stem + ".report.json", json.dumps(report, indent=1))
    print(
        f"converted {len(written)} | skipped {len(skipped)} (listed in {stem}.skipped.jsonl) -> {c.out}"
    )
    for reason, n in report["reasons"].items():
        print(f"  {n:8d}  {reason}")
    return report


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))

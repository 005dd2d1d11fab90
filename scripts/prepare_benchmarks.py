"""The steps some benchmark downloads need before evaluate.py reads them (docs/benchmarks.md: what to download).

    python scripts/prepare_benchmarks.py --benchmark egoschema --src EgoSchema --out data/benchmarks
    python scripts/prepare_benchmarks.py --benchmark nextqa --src NExT-QA/NExTVideo --out data/videos

egoschema: the release's questions.json (5,031 questions, options "option 0".."option 4") joined with
subset_answers.json ({q_uid: option index}, the 500 public answers) into OUT/egoschema.json; a question without a
public answer keeps "answer": null, which evaluate.py counts as "no ground truth" (the full set is graded by the
authors' server). nextqa: the release keeps its videos in NExTVideo/<folder>/<video>.mp4 with map_vid_vidorID.json
({video: "<folder>/<video>"}) beside them; OUT/nextqa/<video>.mp4 become hard links to them, the layout the adapter
reads (regular files inside the video folder; a symlink out of it needs evaluate.py's --allow-outside-media).
Every step is checked: a missing file, an id the other file lacks, or a malformed entry is an error naming it.
"""

import json
import os
from dataclasses import dataclass
from typing import Literal


@dataclass
class Config:
    benchmark: Literal["egoschema", "nextqa"]
    """which download to prepare"""
    src: str
    """the downloaded folder: EgoSchema's (questions.json, subset_answers.json) or NExT-QA's NExTVideo"""
    out: str = "data/benchmarks"
    """egoschema: the --data-dir of evaluate.py; nextqa: its --video-dir"""


def load_json(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (docs/benchmarks.md says what to download)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def egoschema(src: str, out: str) -> dict:
    """questions.json + subset_answers.json -> OUT/egoschema.json; the counts."""
    questions = load_json(os.path.join(src, "questions.json"))
    answers = load_json(os.path.join(src, "subset_answers.json"))
    if not isinstance(questions, list) or not all(
        isinstance(q, dict) and "q_uid" in q for q in questions
    ):
        raise ValueError(f"{src}/questions.json: expected a JSON array of objects with q_uid")
    if not isinstance(answers, dict):
        raise ValueError(f"{src}/subset_answers.json: expected {{q_uid: option index}}")
    if unknown := sorted(set(answers) - {q["q_uid"] for q in questions}):
        raise ValueError(
            f"{src}/subset_answers.json: {len(unknown)} q_uid not in questions.json, first {unknown[0]}"
        )
    for q_uid, a in answers.items():
        if type(a) is not int or not 0 <= a <= 4:  # JSON's true is no index
            raise ValueError(
                f"{src}/subset_answers.json: {q_uid}: answer {a!r} is not an option index 0..4"
            )
    rows = [dict(q, answer=answers.get(q["q_uid"])) for q in questions]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "egoschema.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    return {"questions": len(rows), "with answer": len(answers)}


def nextqa(src: str, out: str) -> dict:
    """OUT/nextqa/<video>.mp4 hard-linked to SRC/<folder>/<video>.mp4 by map_vid_vidorID.json; the counts."""
    mapping = load_json(os.path.join(src, "map_vid_vidorID.json"))
    if not isinstance(mapping, dict):
        raise ValueError(f"{src}/map_vid_vidorID.json: expected {{video: '<folder>/<video>'}}")
    os.makedirs(os.path.join(out, "nextqa"), exist_ok=True)
    linked = missing = 0
    for video, rel in mapping.items():
        target = os.path.abspath(os.path.join(src, f"{rel}.mp4"))
        link = os.path.join(out, "nextqa", f"{video}.mp4")
        if not os.path.isfile(target):
            missing += 1  # evaluate.py reports each question of a missing video as "missing media"
            continue
        if os.path.lexists(link):
            os.remove(link)
        os.link(target, link)  # OUT on another filesystem: OSError, copy or move the videos instead
        linked += 1
    return {"videos linked": linked, "videos missing": missing}


def main(cfg: Config) -> dict:
    counts = {"egoschema": egoschema, "nextqa": nextqa}[cfg.benchmark](cfg.src, cfg.out)
    print(f"{cfg.benchmark}: {', '.join(f'{k} {v}' for k, v in counts.items())}", flush=True)
    return counts


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))

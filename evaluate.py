"""evaluate.py: video benchmarks, each read and aggregated by its official rule, on vLLM's
asynchronous engine.

    python evaluate.py --model DIR --benchmarks videomme,mvbench --data-dir ANN --video-dir VID
    python evaluate.py --model DIR --benchmarks nvr1 --data-dir .cache/data/color   # our own schema

Benchmarks are data (configs/benchmarks/benchmarks.yaml); the pipeline, resume and failure
accounting: README.md "Evaluation"; each benchmark's reading and aggregation rule:
docs/benchmarks.md.
"""

import ast
import asyncio
import copy
import csv
import glob
import hashlib
import json
import math
import operator
import os
import random
import re
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from functools import cache as cached, partial
from typing import Literal

import yaml

import cache
import common
import data
import rewards
from common import ANSWERS, UserError, fact, write_jsonl, write_text
from data import DataError


# The settings of an evaluation; Media (cache.py) declares the frame and image ones. ANSWERS beside a field (the
# frame settings' too): it changes the answers, so a resume log written under another value is refused.
@dataclass
class Config(cache.Media):
    config: tuple[str, ...] = ()
    """YAML files of these settings, each over the ones before (bad keys fail); flags win"""
    model: str = ".cache/models/tiny-qwen2_5_vl"
    """HF model folder (Qwen2-VL, Qwen2.5-VL or Qwen3-VL)"""
    benchmarks: str = "nvr1"
    """comma-separated benchmark names (configs/benchmarks/benchmarks.yaml)"""
    data_dir: str = "data/benchmarks"
    """annotation files: {data_dir}/{name}.json|.jsonl|.parquet or a folder of them (nvr1: also {data_dir}/val.jsonl)"""
    video_dir: str = "data/videos"
    """videos: {video_dir}/{name}/<the path the record names>"""
    out_dir: str = ""
    """results.json, results.md and {name}/samples.jsonl (the resume log); '' = runs/eval/<model name>-<path hash>"""
    engine: Literal["async", "sync", "hf"] = fact("async", ANSWERS)
    """async (vLLM AsyncLLM pipeline) | sync (colocated vLLM LLM, batch by batch) | hf (transformers generate)"""
    max_samples: int = 0
    """per benchmark, the first N samples (0 = all)"""
    max_tokens: int = fact(64, ANSWERS)
    """response budget (EasyVideoR1 uses 2048 with thinking)"""
    temperature: float = fact(0.0, ANSWERS)
    """0 = greedy (deterministic)"""
    seed: int = fact(0, ANSWERS)
    """sampling seed, and the seed of the random-option fallback"""
    response_format: Literal["answer", "think_answer"] = fact("answer", ANSWERS)
    """the format our own prompts (nvr1, a template's {{ instruction }}) ask for, as train.py's"""
    answer_extraction: Literal["tags", "official"] = fact("tags", ANSWERS)
    """tags: our <answer>/<think> pre-step, then the benchmark's reader; official: its reader on the raw response"""
    random_fallback: bool = fact(False, ANSWERS)
    """where the official scorer guesses (benchmarks.yaml `guess`), an unreadable answer gets a seeded random option"""
    allow_failures: bool = False
    """exit 0 even when samples could not be evaluated (they are still listed and never scored)"""
    max_in_flight: int = 64
    """samples loaded or generating at once (the bound on memory)"""
    loader_threads: int = 2
    """threads reading frames and building prompts"""
    batch_size: int = 16
    """sync/hf engines: prompts per generate call"""
    max_model_len: int = fact(0, ANSWERS)
    """vLLM context length; 0 = 16384 (64 frames x 262,144 px, text and response) or the model's positions if fewer"""
    max_prompt_len: int = fact(0, ANSWERS)
    """longer prompts are an error for that sample (never truncated); 0 = max_model_len - max_tokens"""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = fact("auto", ANSWERS)
    """vLLM dtype (auto = the checkpoint's, bf16 for Qwen-VL)"""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel GPUs per engine"""
    data_parallel_size: int = 1
    """vLLM data parallel engines (async engine): tensor_parallel_size x data_parallel_size = the node's GPUs"""
    gpu_memory_utilization: float = 0.9
    """share of each GPU's memory vLLM may take"""
    judge_model: str = fact("", ANSWERS)
    """HF folder of an LLM judge for open-ended items, or with judge_url the name it is served under
    ('' = rule-based fallback, reported as such)"""
    judge_url: str = ""
    """OpenAI-compatible API base of a served judge (http://host:port/v1; '' = run judge_model here)"""
    trust_remote_code: bool = False
    """let transformers/vLLM run code shipped with the checkpoint"""
    video_max_frames: int = fact(64, ANSWERS)
    """at most this many frames per video (evaluation's default; training's is 32)"""
    video_max_pixels: int = fact(262144, ANSWERS)
    """max pixels per frame (evaluation's default; training's is 100352)"""


# A training config read by evaluate.py: the keys of train.Config it takes under its own names, and the shared ones it
# takes as they are (not the run's out_dir, nor its rollouts' temperature: held-out answers are greedy)
FROM_TRAINING = {"max_response_len": "max_tokens", "eval_max_samples": "max_samples"}
SHARED = (
    "model trust_remote_code seed max_prompt_len max_model_len gpu_memory_utilization response_format"
).split()


def load_config(argv: list[str]) -> Config:
    """common.load_config for Config, a training config too (a key of train.Config that is none of ours): read as
    the in-training evaluation reads it, its held-out frame settings (train.Config.media(held_out=True), train.py's
    defaults included), FROM_TRAINING and SHARED; its other keys are listed once and ignored. A key neither knows is
    an error."""
    import train

    paths, rest = common.config_files(argv)
    base = Config()
    run = train.Config()
    unused = []
    for path in paths:
        ours = []
        theirs = []
        base = common.yaml_overlay(base, path, strict=False, skipped=ours)
        run = common.yaml_overlay(run, path, strict=False, skipped=theirs)
        for key in ours:
            if key in theirs:
                raise UserError(f"{path}: unknown key {key!r}")
        unused += ours
    if unused:
        media = asdict(run.media(held_out=True))
        renamed = {ours: getattr(run, key) for key, ours in FROM_TRAINING.items()}
        shared = {k: getattr(run, k) for k in SHARED}
        base = replace(
            base,
            **media,
            **renamed,
            **shared,
            out_dir=Config.out_dir,
            temperature=Config.temperature,
        )
        read = [*FROM_TRAINING, *(f"val_{f.name}" for f in fields(cache.Media))]
        print(
            f"{' '.join(paths)}: a training config: its held-out frame settings and {', '.join(FROM_TRAINING)} "
            f"read; not used: {', '.join(sorted(set(unused) - set(read)))}",
            file=sys.stderr,
        )
    return common.parse_flags(Config, base, paths, rest)


# annotation files, in the order they are looked for
FORMATS = (".jsonl", ".json", ".parquet", ".csv", ".txt")
BENCHMARKS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "configs", "benchmarks", "benchmarks.yaml"
)
# a benchmark's fields in BENCHMARKS (documented there)
FIELDS = (
    "prompt q opts ans id video nested type extract derive read index guess keys macro group tiou "
    "judge after own nest line prefixes drop judge_all authority end scale audio"
).split()


# a judge rule's fields (benchmarks.yaml)
JUDGE_FIELDS = {"user", "keys", "system", "verdict"}
# the fields a benchmark that does not name them reads
DEFAULT_FIELDS = {"q": "question", "opts": "options", "ans": "answer", "read": [["[{L}]", 0]]}


def adapter_problem(ad) -> str:
    """What is wrong with one benchmark's definition, '' when nothing."""
    if not isinstance(ad, dict):
        return f"expected a mapping of fields, got {type(ad).__name__}"
    unknown = sorted(set(ad) - set(FIELDS))
    if unknown:
        return f"unknown field(s) {unknown}; known: {', '.join(FIELDS)}"
    if isinstance(ad.get("read"), str) and ad["read"] not in READERS:
        return (
            f"unknown reader {ad['read']!r}; known: {', '.join(READERS)} or a list of [pattern, "
            "pick] rules"
        )
    for rule in (ad.get("type"), *ad.get("derive", {}).values()):
        if not isinstance(rule, dict):
            continue
        if not {"field", "map"} <= set(rule) <= {"field", "map", "default"}:
            return "a type or derive rule takes field, map and (optionally) default"
    rules = [ad.get("judge")]
    if isinstance(rules[0], dict) and "user" not in rules[0]:  # by question type
        rules = list(rules[0].values())
    for rule in rules:
        if isinstance(rule, dict) and not {"user", "keys"} <= set(rule) <= JUDGE_FIELDS:
            return f"a judge rule takes user, keys and (optionally) system, verdict; got {rule!r}"
    return ""


@cached
def load_adapters(path: str = BENCHMARKS) -> dict[str, dict]:
    """Every benchmark's definition, default field names filled in; a ValueError names the file,
    benchmark and fault."""
    with open(path, encoding="utf-8") as f:
        table = yaml.safe_load(f)
    for name, ad in table.items():
        problem = adapter_problem(ad)
        if problem:
            raise UserError(f"{path}: benchmark {name!r}: {problem}")
    return {name: {**DEFAULT_FIELDS, **ad} for name, ad in table.items()}


def adapter(bench: str) -> dict:
    """One benchmark's definition from BENCHMARKS."""
    if bench not in load_adapters():
        raise UserError(f"unknown benchmark {bench!r}; known: {', '.join(load_adapters())}")
    return load_adapters()[bench]


def first(r: dict, fields):
    """The value of a field, or of the first field of a list that the record has (layouts or tasks
    differ)."""
    names = fields if isinstance(fields, list) else [fields]
    for k in names:
        if k in r:
            return r[k]
    raise KeyError(" or ".join(names))


def lookup(r: dict, rule: dict):
    """A type or derived field by rule {field, map, default}: map[str(r[field])], else default, else
    r[field]."""
    value = r.get(rule["field"])
    return rule["map"].get(str(value), rule.get("default", value))


# an option line: "A. x", "(A) x", "A) x", "A: x", and TempCompass caption matching's
# "Caption A: x", "Sentence A: x", "Option 1: x" (1-based)
_OPTION = re.compile(
    r"\s*(?:(?:Caption|Sentence|Option)\s+([A-Z1-9])|\(?([A-Z])\)?)[.):]\s?(.*)", re.S
)


def option_letter(m: re.Match) -> str:
    label = m.group(1) or m.group(2)
    return chr(64 + int(label)) if label.isdigit() else label


def parse_file(f: str, ad: dict) -> list[tuple[str, object]]:
    """(where in f, record) for each record of one annotation file; a record that does not parse is
    a DataError."""
    if f.endswith(".parquet"):
        import pyarrow.parquet as pq

        return [(str(i + 1), r) for i, r in enumerate(pq.read_table(f).to_pylist())]
    with open(f, encoding="utf-8", newline="") as fh:
        if f.endswith(".csv"):  # NExT-QA: the header names the fields; where = the line
            rows = csv.DictReader(fh)
            return [(str(rows.line_num), r) for r in rows]
        if f.endswith(".json"):
            return walk(json.load(fh), ad.get("nest", ()), "")
        # one record a line: .jsonl, or .txt read by the benchmark's line pattern
        pattern = None
        if f.endswith(".txt"):
            pattern = ad.get("line")
            if not pattern:
                raise DataError(f"this benchmark reads no .txt (it reads {', '.join(FORMATS[:4])})")
        return [
            (str(i + 1), line_record(line, pattern)) for i, line in enumerate(fh) if line.strip()
        ]


def line_record(line: str, pattern: str | None):
    """A .txt line by the benchmark's `line` pattern, a .jsonl line as JSON; what does not parse: a
    DataError."""
    if pattern:
        m = re.fullmatch(pattern, line.strip())
        if not m:
            return DataError(f"line does not match {pattern!r}")
        return m.groupdict()
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        return DataError(f"not JSON: {e}")


def walk(node, names, where: str) -> list[tuple[str, object]]:
    """A JSON array of records, or a release nested in dicts whose keys become the fields `names`
    (TempCompass's {video_id: {dim: [...]}}, Video-MMMU's {track: {index: {...}}}); where = record
    number or key path."""
    if isinstance(node, list):
        return [(f"{where}{i + 1}", r) for i, r in enumerate(node)]
    if not isinstance(node, dict):
        raise DataError(f"expected a JSON array of records, got {type(node).__name__}")
    if not names and where:  # the end of a key path: a record
        return [(where.rstrip("/"), node)]
    if not names:
        raise DataError(
            "expected a JSON array of records, got dict "
            "(a nested release: the benchmark's `nest` names its keys)"
        )
    out = []
    for k, v in node.items():
        for w, r in walk(v, names[1:], f"{where}{k}/"):
            if isinstance(r, dict):
                r = {**r, names[0]: k}
            out.append((w, r))
    return out


def option_list(r: dict, ad: dict, question: str) -> list[str]:
    """The options as "A. text": from a list, {letter: text}, lines, several fields, or (opts null)
    the question."""
    opts = ad["opts"]
    if isinstance(opts, list):
        # one option a field (a field holding a list: all of them), absent fields skipped
        if not any(k in r for k in opts):
            raise KeyError(opts[0])
        raw = []
        for k in opts:
            values = r[k] if isinstance(r.get(k), list) else [r.get(k)]
            for x in values:
                if isinstance(x, (bool, dict, list)):
                    raise DataError(f"field {k!r} must hold option texts, got {x!r}")
            raw += [x for x in values if x not in (None, "", "N/A")]
    elif opts:
        raw = r[opts] or []
    else:
        raw = [line for line in question.split("\n") if _OPTION.match(line)]
    if isinstance(raw, str) and raw.strip().startswith("["):
        raw = literal_list(raw, opts)
    if isinstance(raw, str):
        raw = raw.split("\n")
    if isinstance(raw, dict):
        raw = [f"{k}. {v}" for k, v in raw.items()]
    kinds = (str, int, float)
    if not isinstance(raw, list) or not all(
        isinstance(o, kinds) and not isinstance(o, bool) for o in raw
    ):
        got = type(raw).__name__
        if isinstance(raw, list):
            got = f"a list holding {', '.join(sorted({type(o).__name__ for o in raw}))}"
        raise DataError(f"field {opts!r} must be a list of option texts, got {got}")
    matches = [_OPTION.match(str(o)) for o in raw]
    # lettered only when labelled A, B, C... in order (lmms-eval's videommmu parse_options): Video-MMMU's
    # "M: $57,000; N: ..." or "R.L at point C" are option texts
    if raw and all(m and option_letter(m) == chr(65 + i) for i, m in enumerate(matches)):
        return [f"{option_letter(m)}. {m.group(3).strip()}" for m in matches]
    return [f"{chr(65 + i)}. {o}" for i, o in enumerate(raw)]


def literal_list(text: str, name) -> list:
    """A field holding a list written as a Python literal (MMMU's own code eval()s its options):
    parsed as a literal only, never run."""
    try:
        value = ast.literal_eval(text[:100_000])
    except (ValueError, SyntaxError, RecursionError, MemoryError) as e:
        raise DataError(f"field {name!r} holds no list literal ({type(e).__name__})") from e
    if not isinstance(value, list):
        raise DataError(f"field {name!r} must be a list, got {type(value).__name__}")
    return value


def answer_letter(ans, options: list[str], ad: dict) -> str:
    """The ground truth as the data.py sample holds it: an option's letter for letter choices, else
    the text."""
    # an option index (EgoSchema "1", LongVideoBench 2); OVO-Bench's counts: as is
    if ad.get("index") and options:
        if isinstance(ans, bool) or not str(ans).strip().isdigit() or int(ans) >= len(options):
            raise DataError(f"answer {ans!r} is not an option index 0..{len(options) - 1}")
        return chr(65 + int(ans))
    if not isinstance(ans, (str, int, float)) or isinstance(ans, bool):
        raise DataError(f"answer must be a string or number, got {type(ans).__name__}")
    text = str(ans)
    texts = [o[3:] for o in options]
    if text in texts:  # the text of the right candidate (MVBench)
        return chr(65 + texts.index(text))
    m = _OPTION.match(text)  # "C. blue", "Caption B: ...", "(B)"
    if options and m:
        return option_letter(m)
    # MLVU's scorer makes a ground truth no option's text "(@)": never right
    if options and len(text) > 1 and rewards.choice_letter(text, options) is None:
        raise DataError(f"answer {ans!r} is no option's letter nor text (options: {texts})")
    return text


# a derive template's field: "{video_id}.mp4" ("{{" is a literal brace)
_TEMPLATE_FIELD = re.compile(r"(?<!{){(\w+)}")


def with_derived(r: dict, ad: dict) -> dict:
    """The record with the benchmark's `extract` and `derive` fields added, where it has what they
    need (a benchmark may have several layouts: a field the layout needs is reported missing
    later)."""
    r = dict(r)
    for name, pattern in ad.get("extract", {}).items():
        if name not in r:
            continue
        m = re.search(pattern, str(r[name]))
        if not m:
            raise DataError(f"field {name!r} ({r[name]!r}) does not match {pattern!r}")
        r = {**m.groupdict(), **r}  # a field the record has keeps its value
    for name, rule in ad.get("derive", {}).items():
        if isinstance(rule, str) and set(_TEMPLATE_FIELD.findall(rule)) <= set(r):
            r[name] = rule.format(**r)
        elif isinstance(rule, dict) and rule["field"] in r:
            r[name] = lookup(r, rule)
    return r


def kept_fields(r: dict, ad: dict) -> dict:
    """The record's breakdown fields (`keys`) and group field, where it has them: the rows carry
    them."""
    return {k: r[k] for k in (*ad.get("keys", ()), ad.get("group")) if k in r}


def video_end(r: dict, ad: dict) -> float:
    """The video up to the question's moment, rounded up (OVO-Bench's chunk_videos.py)."""
    end = r[ad["end"]]
    seconds = isinstance(end, (int, float)) and not isinstance(end, bool) and 0 <= end < math.inf
    if not seconds:
        raise DataError(f"field {ad['end']!r} must be a time in seconds, got {end!r}")
    return float(math.ceil(end))


def to_sample(r: dict, ad: dict, where: str, video_root: str) -> dict | None:
    """A released record -> a validated data.py sample (None: no ground truth); DataError names
    where and the field."""
    try:
        if isinstance(r, DataError):  # a record that did not parse
            raise r
        if not isinstance(r, dict):
            raise DataError(f"expected a JSON object, got {type(r).__name__}")
        r = with_derived(r, ad)
        question = first(r, ad["q"])
        ans = first(r, ad["ans"])
        if not isinstance(question, str):
            raise DataError(f"field {ad['q']!r} must be a string, got {type(question).__name__}")
        pt = ad.get("type", "multiple choice")
        if isinstance(pt, dict):
            pt = lookup(r, pt)
        options = []
        if pt == "multiple choice":
            options = option_list(r, ad, question)
            if len(options) < 2:  # `options: 5` is one option, never a question
                raise DataError(
                    f"field {ad['opts']!r}: a multiple choice of {len(options)} options"
                )
        blank = [o[0] for o in options if not o[3:]]
        # MLVU's qa_template: an empty answer is the last empty option's letter (3 records)
        if ans == "" and blank:
            ans = blank[-1]
        elif ans is None or str(ans).strip() in ("", "NA", "None"):
            return None
        sid = f"{r['_file']}:{where.rsplit(':', 1)[1]}"  # no id field: file stem and line
        if ad.get("id") in r:
            sid = r[ad["id"]]
            if not isinstance(sid, (str, int)) or isinstance(sid, bool):
                raise DataError(f"field {ad['id']!r} must be a string or integer, got {sid!r}")
            sid = str(sid)
        s = {
            "id": sid,
            "problem": question,
            "answer": answer_letter(ans, options, ad),
            "problem_type": pt,
            "options": options,
            "videos": [os.path.join(video_root, ad["video"].format(**r))],
            **kept_fields(r, ad),
        }
        if ad.get("end"):
            s["video_end"] = video_end(r, ad)
    except DataError as e:
        raise DataError(f"{where}: {e}") from e
    except KeyError as e:
        raise DataError(f"{where}: missing field {e}") from e
    except (TypeError, ValueError, IndexError, AttributeError) as e:  # a wrong-typed field
        raise DataError(f"{where}: bad field ({type(e).__name__}: {e})") from e
    return data.validate_sample(s, where)


def find_annotations(name: str, cfg: Config) -> list[str]:
    """The benchmark's annotation files: {data_dir}/{name}.<format> or the files of the folder
    {data_dir}/{name}."""
    paths = [os.path.join(cfg.data_dir, name + e) for e in FORMATS]
    folder = os.path.join(cfg.data_dir, name)
    files = [p for p in paths if os.path.isfile(p)][:1]
    if not files and os.path.isdir(folder):
        files = [f for f in sorted(glob.glob(os.path.join(folder, "*"))) if f.endswith(FORMATS)]
    if not files:
        raise FileNotFoundError(
            f"{name}: no annotation file ({', '.join(FORMATS)}) at {' or '.join(paths)} or in the "
            f"folder {folder} (docs/benchmarks.md: what to download, the layout)"
        )
    return files


def questions_of(f: str, ad: dict) -> list[tuple[str, object]]:
    """(file:N, question record, or the DataError that stands for it) of one annotation file; a
    video's nested questions (LVBench's qa) are one record each, the video's fields with each
    question's."""
    try:
        rows = parse_file(f, ad)
    # JSONDecodeError and DataError are ValueErrors; a broken parquet too
    except (OSError, ValueError) as e:
        return [(f, DataError(f"{type(e).__name__}: {e}"))]
    nested = ad.get("nested", "").rstrip("?")
    # "field?": records without the field are questions themselves
    optional = ad.get("nested", "").endswith("?")
    stem = os.path.basename(f).split(".")[0]
    out = []
    for at, r in rows:
        if isinstance(r, dict):
            r = dict(r, _file=stem)
        plain = not nested or not isinstance(r, dict) or (optional and nested not in r)
        if plain:
            out.append((f"{f}:{at}", r))
        elif isinstance(r.get(nested), list) and all(isinstance(qa, dict) for qa in r[nested]):
            for j, qa in enumerate(r[nested]):
                out.append((f"{f}:{at}.{nested}[{j}]", {**r, **qa, nested: j}))
        else:
            out.append(
                (f"{f}:{at}", DataError(f"field {nested!r} must be a list of question objects"))
            )
    return out


def own_annotations(name: str, cfg: Config) -> str:
    """Our schema's file (the README's --data-dir .cache/data/color holds val.jsonl)."""
    paths = [
        os.path.join(cfg.data_dir, p) for p in (f"{name}/val.jsonl", "val.jsonl", f"{name}.jsonl")
    ]
    for p in paths:
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"{name}: no annotations at {' or '.join(paths)}")


def load_benchmark(name: str, cfg: Config, skipped: list, bad: list | None = None) -> list[dict]:
    """One benchmark's samples; no ground truth: skipped, a broken record: bad as {where, error}
    (None: raise). Ids that several records share get their record's place appended (a warning on
    stderr); then --max-samples cuts."""
    ad = adapter(name)
    errors = [] if bad is None else bad
    out = []
    rows = []
    if ad.get("own"):
        path = own_annotations(name, cfg)
        files = [path]
        # media are checked with every benchmark's (prepare_benchmark)
        out = data.load_samples(path, allow_outside=cfg.allow_outside_media, check_media=False)
    else:
        files = find_annotations(name, cfg)
        rows = [x for f in files for x in questions_of(f, ad)]
    # relative to the working directory (validate_sample joins a relative one to the annotations')
    root = os.path.abspath(os.path.join(cfg.video_dir, name))
    for where, r in rows:
        try:
            s = to_sample(r, ad, where, root)
            if s and not cfg.allow_outside_media:
                data.check_inside(s, root, where)
        except DataError as e:
            errors.append({"where": where, "error": str(e)})
            continue
        if s is None:
            skipped.append({"where": where, "error": "no ground truth"})
        else:
            out.append(dict(s, where=where))
    if not out:
        reasons = [e["error"] for e in errors] + [f"{x['where']}: no ground truth" for x in skipped]
        reasons.append("no records")
        raise DataError(
            f"{name}: 0 samples loaded from {', '.join(files)} ({len(errors)} bad records, "
            f"{len(skipped)} without ground truth; first: {reasons[0]}; docs/benchmarks.md: "
            "what to download, the layout, the preparation step)"
        )
    out = data.unique_ids(out, name)
    if errors and bad is None:  # the error names where
        raise DataError(f"{name}: {len(errors)} bad records, first: {errors[0]['error']}")
    return out[: cfg.max_samples or None]


# --------------------------------------------------------------------------------------------------
# official answer readers: (answer text, sample) -> (what was read or None when nothing could be,
# score in [0, 1]). Every pattern is linear (bounded, possessive or atomic quantifiers, none nested)
# on text cut to rewards.MAX_LEN.
def letters_of(s: dict) -> str:
    return "".join(lt for lt, _ in rewards.option_table(s["options"]))


def gt_letter(s: dict) -> str:
    return rewards.choice_letter(rewards.ground_truth(s), s["options"]) or rewards.ground_truth(s)


def read_pattern(text: str, s: dict, rules: tuple):
    """The letter the first of rules (pattern, pick: 0 first hit, -1 last) finds, {L} the option
    letters."""
    letters = letters_of(s)
    for pattern, pick in rules:
        hits = re.findall(pattern.replace("{L}", letters), text)
        if hits:
            return hits[pick], float(hits[pick] == gt_letter(s))
    return None, 0.0


def read_vsi(text: str, s: dict):
    """VSI-Bench: the first token, trailing '.' stripped; letters exact (any case), numbers by
    float() and MRA."""
    token = text.split(" ")[0].rstrip(".").strip()
    if s["problem_type"] == "multiple choice":
        return token or None, float(token.lower() == gt_letter(s).lower())
    value = rewards.as_float(token)
    if value is None:
        return None, 0.0
    return token, rewards.mra(value, float(rewards.ground_truth(s)))


def read_mvbench(text: str, s: dict):
    """MVBench check_ans on the first word of the first line, after the "Best option:" primer of the
    prompt."""
    text = re.sub(r"(?i)^best option:", "", text.strip().split("\n")[0]).strip()
    word = text.lower().split(" ")[0]
    if not any(c in word for c in "abcdefg"):
        return None, 0.0
    return check_ans(word, s)


def read_mvbench_official(text: str, s: dict):
    """MVBench as mvbench.ipynb scores it: infer_mvbench's return_prompt "(" + the first line, then
    check_ans on the first word (dots removed) in "(b)" or holding it; never unreadable. Strict: a
    "Best option: (B)" echo is wrong, and an empty answer ("(" is in "(b)") right."""
    return check_ans(("(" + text.strip().split("\n")[0]).lower().split(" ")[0], s)


def check_ans(word: str, s: dict):
    """MVBench's check_ans: right when the word, dots removed, is inside "(b)" or holds it."""
    gt = f"({gt_letter(s).lower()})"
    return word, float(word.replace(".", "") in gt or gt in word)


def read_worldsense(text: str, s: dict):
    """WorldSense (lmms-eval tasks/worldsense utils.py parse_multi_choice_response): read_choice on
    options A-D (A-C for 3), every letter written anywhere a candidate placed at its "(X)" (its
    "(A)" comment aside, the code looks for the bare letter): several, the one whose "(X)" is
    written last, none written so, the first in letter order (numpy argmax); no letter: (over 5
    words) the options whose text is written, the last written; nothing: "A" (its random choice is
    commented out)."""
    four = dict(s, options=s["options"][:4])
    got = read_choice(text, four, ((("{}",), "({})"),))[0] or letters_of(s)[0]
    return got, float(got == gt_letter(s))


def read_ovo(text: str, s: dict):
    """OVO-Bench score.py: the right letter anywhere; REC: all digits joined; SSR/CRR: "Y"/"N" or
    "Yes"/"No" in."""
    gt = rewards.ground_truth(s)
    if s["problem_type"] == "counting":
        digits = "".join(re.findall(r"\d+", text))
        return digits or None, float(digits == gt)
    if s["problem_type"] == "boolean":
        word = "Yes" if gt == "yes" else "No"
        return text or None, float(text == word[0] or word in text)
    return text or None, float(gt_letter(s) in text)


# MMMU (Video-MMMU's official scorer): numbers with commas, scientific, plain; bounded digit runs
# (linear time)
_MMMU_NUMBERS = (
    r"-?\b\d{1,3}(?:,\d{3}){1,12}\b",
    r"-?\d{1,40}(?:\.\d{1,40})?[eE][+-]?\d{1,4}",
    r"-?(?:\d{1,40}\.\d{1,40}|\.\d{1,40}|\d{1,40})(?![eE][+-]?\d)(?![,\d])",
)


def mmmu_norm(x: str) -> list:
    """MMMU normalize_str: a number -> [its value rounded to 2 decimals]; a one-letter string gets
    spaces."""
    x = x.strip()
    try:
        return [round(float(x.replace(",", "")), 2)]
    except ValueError:
        x = x.lower()
        return [" " + x, x + " "] if len(x) == 1 else [x]


# Video-MMMU parse_open_response's key words, each with its trailing space: the shortest tail after
# one of them, per line, holds the answer
MMMU_KEYS = tuple(
    f"{k} "
    for k in (
        "could be|so|is|thus|therefore|final|answer|result|are|in total|total|identify|recognize|"
        "calculated as|counted as|measured as|observed as|concluded as|found to be|equals|"
        "determined to be|number of|value is|adds up to|have|has"
    ).split("|")
)


def mmmu_open(text: str, gt: str):
    """Video-MMMU parse_open_response + eval_open: key texts and their numbers; numbers compare
    rounded to 2 decimals. The text is lower-cased before it is split, so only line breaks split it
    (as officially)."""
    sentences = re.split(r"\.\s(?=[A-Z])|\n", text.strip().strip(".").lower())
    key = []
    for i, sub in enumerate(sentences):
        words = MMMU_KEYS
        if i == len(sentences) - 1:  # "=" in the last line only
            words = MMMU_KEYS + ("=",)
        shortest = None
        for w in words:
            if w not in sub:
                continue
            tail = sub.split(w)[-1].strip()
            if not shortest or len(tail) < len(shortest):
                shortest = tail
        if shortest and shortest not in (":", ",", ".", "!", "?", ";", "'"):
            key.append(shortest)
    if not key:
        key = [text.strip().strip(".").lower()]
    numbers = [n for k in key for pattern in _MMMU_NUMBERS for n in re.findall(pattern, k)]
    preds = {p for x in key + numbers for p in mmmu_norm(x)}
    golds = mmmu_norm(gt)
    pred_texts = [p for p in preds if isinstance(p, str)]
    gold_texts = [g for g in golds if isinstance(g, str)]
    # a gold text in a predicted one, or an equal number
    ok = any(g in p for p in pred_texts for g in gold_texts)
    ok = ok or any(p in golds for p in preds if not isinstance(p, str))
    return (text or None), float(ok)


def read_choice(text: str, s: dict, stages: tuple, pick=max):
    """MMMU-style multiple choice: the first stage (forms, position) whose forms ("(B)", "B ", ...)
    find option letters, each placed where its form (or the stage's position form) is last written,
    the latest (pick max) or the earliest (min) of them; else (over 5 words) the options whose text
    is written, alike; else None. Ties: the first found."""
    table = rewards.option_table(s["options"])
    for c in ",.!?;:'":
        text = text.strip(c)
    padded = f" {text} "
    found = []  # (where the letter is placed, letter)
    for forms, position in stages:
        for f in forms:
            for lt, _ in table:
                if f.format(lt) in padded:
                    found.append((padded.rfind((position or f).format(lt)), lt))
        if found:
            break
    if not found and len(padded.split()) > 5:  # the option's text, case-insensitive
        low = padded.lower()
        for lt, body in table:
            if body and body.lower() in low:
                found.append((low.rfind(body.lower()), lt))
    got = None
    if found:
        got = pick(found, key=operator.itemgetter(0))[1]
    return got, float(got == gt_letter(s))


def read_videommmu(text: str, s: dict):
    """Video-MMMU (its lmms-eval task): "B.", else "B:", else "(B)", else "B " (placed at " B "),
    else the text; several: the last written; never a guess. Open: mmmu_open. (One stage for "B."
    and "B:" placed at "B." is these two stages: a "B:"-only candidate is never found there.)"""
    if s["problem_type"] != "multiple choice" and not text:
        return None, 0.0
    if s["problem_type"] != "multiple choice":
        return mmmu_open(text, rewards.ground_truth(s))
    return read_choice(
        text, s, ((("{}.",), None), (("{}:",), None), (("({})",), None), (("{} ",), " {} "))
    )


def read_tempcompass(text: str, s: dict):
    """TempCompass's eval_*.py rules per task format (docs/benchmarks.md); captioning:
    read_reward."""
    # captioning: the judge (or, without one, the rule-based fallback)
    if s["problem_type"] == "open-ended":
        return read_reward(text, s)
    text = text.replace("</s>", "").strip()  # each eval_*.py's first step
    if s["problem_type"] == "boolean":
        got = next((w for w in ("yes", "no") if text.lower().startswith(w)), None)
        return got, float(got == rewards.ground_truth(s))
    lines = s["problem"].split("\n")[1:]
    answer = lines[ord(gt_letter(s)) - 65]  # the answer's own line, as the release writes it
    if s.get("format") != "caption_matching":  # the answer line, "C", "C." or "C)" all start so
        return read_pattern(text, s, [(r"^([A-D])(?:[.)]|$)", 0)])
    # caption matching: the whole line, else a caption's sentence, else its label; the last match
    # wins
    sentences = [line.split(": ")[1] for line in lines]
    labels = [line.split(": ")[0] for line in lines]
    labels += [re.sub(r"^(?:Sentence|Option|Caption) ", "", label) for label in labels]  # bare "B"
    got = None
    if text in lines:
        got = text
    for sentence in sentences:
        if sentence == text or (") " in text and sentence == text.split(") ")[1]):
            got = sentence
    for label in labels:
        if label in (text, text.replace(".", "")):
            got = label
    if got is None:
        return None, 0.0
    label = answer.split(": ")[0]
    right = (answer, answer.split(":")[0], answer.split(": ")[1], label.split()[-1])
    return got, float(got in right)


def read_holmes(text: str, s: dict):
    """Video-Holmes evaluate.py: the first of A-F in letter order written "X ", "X:" or "[X", else
    present at all."""
    choice = rewards.last_answer(text, text)
    marked = [c for c in "ABCDEF" if f"{c} " in choice or f"{c}:" in choice or f"[{c}" in choice]
    written = [c for c in "ABCDEF" if c in choice]
    got = None
    if written:
        got = (marked or written)[0]
    return got, float(got == gt_letter(s))


# the official readers that take more than a pattern (the others: a benchmark's `read` rules, for
# read_pattern); they read every problem type of their benchmark
READERS = {
    "vsi": read_vsi,
    "mvbench": read_mvbench,
    "ovo": read_ovo,
    "videommmu": read_videommmu,
    "tempcompass": read_tempcompass,
    "holmes": read_holmes,
    "worldsense": read_worldsense,
    # lmms-eval's EgoSchema reader (an MMMU copy; NExT-QA's too): "(B)", "B ", "B." all at once, the
    # first written of them; else an option's text; else (with --random-fallback) a random option
    "mmmu": partial(read_choice, stages=((("({})", "{} ", "{}."), None),), pick=min),
}
# the strict official reading where the tags mode's reader is lenient
OFFICIAL_READERS = {"mvbench": read_mvbench_official}
# a time span in words: "12.3 - 25.7 seconds", "from 12 to 26", after clock times became seconds
_CLOCK = re.compile(r"(?<![\d:.])(\d{1,2}):(\d{2})(?::(\d{2}))?(?:\.(\d{1,6}))?(?![\d:])")
_SPAN = re.compile(
    r"(?<![\d.])(\d{1,9}(?:\.\d{1,6})?)\s{0,9}(?:s|sec|seconds)?\s{0,9}(?:-|–|to)\s{0,9}"
    r"(\d{1,9}(?:\.\d{1,6})?)"
)


def clock_seconds(m: re.Match) -> str:
    """A clock time "m:ss" or "h:mm:ss" (and a fraction) as seconds."""
    seconds = 0
    for x in m.group(1, 2, 3):
        if x is not None:
            seconds = 60 * seconds + int(x)
    return f"{seconds}.{m.group(4) or 0}"


def read_span(text: str, s: dict):
    """Our JSON {"time": [s, e]}, else the first "a - b" / "a to b" span, clock times as seconds;
    IoU."""
    obj = rewards.parse_json(text)
    ours = isinstance(obj, dict) and rewards.as_span(obj.get("time")) is not None
    span = _SPAN.search(_CLOCK.sub(clock_seconds, text))
    if not ours and span:
        text = json.dumps({"time": sorted(float(x) for x in span.groups())})
    return read_reward(text, s)


def read_reward(text: str, s: dict):
    """Our schema, and types without an official reader: the training reward's rule."""
    v = rewards.accuracy(text, s)
    if v is None:
        return None, None
    return text, v


def answer_of(response: str, ad: dict, extraction: str = "tags") -> str:
    """What the benchmark's reader gets: tags, our <answer>/<think> pre-step first; official, the
    raw response."""
    text = response
    if extraction == "tags":
        text = rewards.answer_text(response)
    after = ad.get("after")
    if after and after in text:
        text = text[text.rfind(after) + len(after) :].lstrip(" :*")
    # the benchmark's own answer prefixes, dropped wherever they stand
    for p in ad.get("prefixes", ()):
        text = text.replace(p, "")
    return text


def score(
    response: str, s: dict, ad: dict, guess_seed: int | None = None, extraction: str = "tags"
) -> tuple[str | None, float | None]:
    """(what was read, score in [0, 1]); score None: nothing could be read. guess_seed: the official
    random guess."""
    text = answer_of(response, ad, extraction)
    t = rewards.canonical_type(s["problem_type"])
    read = ad["read"]
    if ad.get("own"):
        rule = read_reward
    elif t == "temporal grounding":
        rule = read_span
    elif isinstance(read, str):
        rule = READERS[read]
        if extraction == "official":  # where tags mode is lenient (docs/benchmarks.md)
            rule = OFFICIAL_READERS.get(read, rule)
    elif t == "multiple choice":
        rule = partial(read_pattern, rules=read)
    else:
        rule = read_reward
    try:
        parsed, v = rule(text, s)
    # a reader never costs the run: the answer counts as unreadable
    except Exception:  # noqa: BLE001
        parsed = None
        v = None
    if parsed is None and guess_seed is not None and ad.get("guess") and s["options"]:
        parsed = random.Random(f"{guess_seed}:{s['id']}").choice(letters_of(s))
        return parsed, float(parsed == gt_letter(s))
    if parsed is None:
        return None, None
    return parsed, v


def record(
    s: dict,
    bench: str,
    prompt: str,
    response: str,
    error: str = "",
    guess_seed: int | None = None,
    extraction: str = "tags",
) -> dict:
    """One per-sample row, lmms-eval fields (doc_id, input, target, resps, filtered_resps), score;
    error: not scored. dropped: left out of the accuracy's denominator by the benchmark's `drop`
    rule (unreadable or empty answers)."""
    ad = adapter(bench)
    pt = rewards.canonical_type(s["problem_type"])
    parsed = None
    v = None
    if not error:
        parsed, v = score(response, s, ad, guess_seed, extraction)
    dropped = False
    if ad.get("drop") == "empty":
        dropped = not response.strip()
    if ad.get("drop") == "unreadable" and v is None and not error:
        # judged on the raw response too: an answer our pre-step empties (an unfinished <think>) but
        # the official reader reads is not dropped
        dropped = extraction == "official" or score(response, s, ad, None, "official")[1] is None
    row = {
        "doc_id": s["id"],
        "input": prompt,
        "target": rewards.ground_truth(s),
        "resps": [response],
        "filtered_resps": [parsed],
        "score": float(v or 0.0),
        "parse_fail": v is None and not error,
        "dropped": dropped and not error,
        "error": error,
        "problem_type": pt,
        **kept_fields(s, ad),
    }
    if ad.get("judge") and (pt == "open-ended" or ad.get("judge_all")):
        row.update(judge="none", question=s["problem"])  # judge_rows rescores it
        rule = judge_rule(ad["judge"], row)
        # a rubric without a right/wrong verdict (MLVU's generation tasks): its own metric, `scale`
        row["scaled"] = isinstance(rule, dict) and not rule.get("verdict")
    return row


def mean(xs) -> float:
    xs = list(xs)
    return 100 * sum(xs) / len(xs) if xs else float("nan")


def macro(rows: list[dict], keys: tuple, value: str = "score") -> float:
    """Mean over keys[0]'s values of the macro over keys[1:] (no keys: the mean) of the rows' value,
    x 100: MLVU M-Avg, VSI and OVO overall."""
    if not keys:
        return mean(r[value] for r in rows)
    groups = {}
    for r in rows:
        groups.setdefault(str(r.get(keys[0])), []).append(r)
    return sum(macro(g, keys[1:], value) for g in groups.values()) / len(groups)


@dataclass(frozen=True)
class GroupRule:
    """How Video-MME-v2 scores a group (one video's questions) by its count right (relevance) or its
    run right from the first question (logic)."""

    den: int
    """the denominator"""
    steps: tuple[int, int, int]
    """the scores of 1, 2 and 3 right (4 right score 100)"""
    branch: tuple[int, int] | None = None
    """(run, index): a run of that length also takes the answer at index (a branch of the logic
    structure)"""


# a group's kind: "relevance" or its logic structure
V2_RULES = {
    "relevance": GroupRule(16, (1, 4, 9)),
    "[1,2,3,4]": GroupRule(16, (1, 4, 9)),
    "[1,[2,3],4]": GroupRule(12, (1, 4, 7), branch=(1, 2)),
    "[[1,2],3,4]": GroupRule(10, (1, 2, 5), branch=(0, 1)),
}


def group_score(g: list[dict]) -> float:
    """Video-MME-v2's cal_relevance (the count right) or cal_logic (the run right from the first) of
    one group; unreadable: -1, truthy, as officially (docs/benchmarks.md)."""
    v = [-1 if r["parse_fail"] else r["score"] for r in g]
    if g[-1].get("group_type") == "logic":
        rule = V2_RULES[re.sub(r"\s", "", str(g[-1].get("group_structure")))]
        run = 0
        while run < len(v) and v[run]:
            run += 1
    else:
        rule = V2_RULES["relevance"]
        run = int(sum(v))
    if rule.branch and run == rule.branch[0] and v[rule.branch[1]]:
        run += 1
    if run == 4:
        return 100.0
    if 1 <= run <= 3:
        return 100 * rule.steps[run - 1] / rule.den
    return 0.0


def group_scores(rows: list[dict], key: str) -> dict:
    """Video-MME-v2's group scores (groups by `key`, one video_id's questions), means: all, per
    type, per level."""
    groups = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    out = {}
    for g in groups.values():
        value = group_score(g)
        for kind in ("", f"/{g[-1].get('group_type')}", f"/level_{g[-1].get('level')}"):
            out.setdefault(f"group_score{kind}", []).append(value)
    return {k: sum(x) / len(x) for k, x in out.items()}


def values_of(r: dict, k: str) -> list:
    """A row's values of a breakdown key: a list field's items, else the one value."""
    if isinstance(r.get(k), list):
        return r[k]
    return [r.get(k)]


def aggregate(rows: list[dict], bench: str) -> dict:
    """One benchmark's official aggregate and breakdowns in percent, over the rows that could be
    evaluated and that its rule does not drop (Video-MME-v2's groups count every row)."""
    ad = adapter(bench)
    macro_keys = ad.get("macro", ())
    done = [r for r in rows if not r["error"]]  # evaluated: n
    # in the accuracy: n - dropped - the rows a rubric scores (their metric: `scale`)
    kept = [r for r in done if not r.get("dropped") and not r.get("scaled")]
    judged = [r for r in done if "judge_score" in r and not r.get("dropped")]
    sc = [r["score"] for r in kept]
    m = {
        "n": len(done),
        "accuracy": mean(sc),
        "parse_fail": sum(r["parse_fail"] for r in done),
        "failed": len(rows) - len(done),
        "dropped": sum(bool(r.get("dropped")) for r in done),
    }
    if ad.get("scale") and judged:  # MLVU G-Avg, Video-MMLU's score: the judge's own scale
        m[ad["scale"]] = macro(judged, macro_keys, "judge_score") / 100
    if macro_keys and kept:
        m["overall"] = macro(kept, macro_keys)
    if ad.get("tiou"):  # grounding: recall at IoU thresholds and mean IoU (the score is the IoU)
        for t in (0.3, 0.5, 0.7):
            m[f"R@{t}"] = mean(x >= t for x in sc)
        m["mIoU"] = mean(sc)
    if ad.get("group") and done and all(ad["group"] in r for r in done):
        m.update(group_scores(done, ad["group"]))
    for k in ad.get("keys", ()):
        # each value's own macro over the other macro keys
        sub = tuple(x for x in macro_keys if x != k)
        values = {v for r in kept for v in values_of(r, k) if v is not None}
        for v in sorted(values, key=str):
            part = [r for r in kept if v in values_of(r, k)]
            m[f"{k}/{v}"] = macro(part, sub)
        # a rubric's rows on its scale (MLVU's SSC and VS columns)
        for v in sorted({str(r.get(k)) for r in judged if r.get("scaled")}):
            part = [r for r in judged if r.get("scaled") and str(r.get(k)) == v]
            m[f"{k}/{v}"] = macro(part, sub, "judge_score") / 100
    return m


# --------------------------------------------------------------------------------------------------
# the pipeline
def failure(s: dict, e: BaseException) -> str:
    """Why a sample could not be evaluated: its file:line and id, the exception and the line that
    raised it."""
    at = traceback.extract_tb(e.__traceback__)[-1:]
    where = f" at {os.path.basename(at[0].filename)}:{at[0].lineno}" if at else ""
    return f"{s.get('where', '?')} sample {s['id']}: {type(e).__name__}: {e}{where}"


def make_loader(processor, cfg, bench: str):
    """load(sample) -> data.Prompt, safe to call from several threads (one processor copy per
    thread)."""
    local = threading.local()
    all_stats = []

    def load(s):
        # a fast tokenizer shared across threads can fail with "Already borrowed"
        if not hasattr(local, "proc"):
            local.proc = copy.deepcopy(processor)
            local.stats = {}
            all_stats.append(local.stats)
        template = adapter(bench).get("prompt")
        return data.prepare(
            s, local.proc, cfg, local.stats, template, cfg.response_format, cfg.max_prompt_len
        )

    return load, all_stats


async def run_async(engine, samples: list, load, cfg: Config, bench: str, write, tokenizer) -> dict:
    """AsyncLLM: loader threads -> engine -> scorer, max_in_flight samples alive; the engine's busy
    share and load."""
    from vllm import SamplingParams

    from rollout import vision_token_ids

    banned = set(vision_token_ids(tokenizer))  # as rollout.VLLMEngine: identical greedy results
    allowed = [i for i in range(engine.model_config.get_vocab_size()) if i not in banned]
    sp = SamplingParams(
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        skip_special_tokens=True,
        allowed_token_ids=allowed,
    )
    loop = asyncio.get_running_loop()
    spans = []  # (start, end) of each request in the engine
    sem = asyncio.Semaphore(cfg.max_in_flight)
    pool = ThreadPoolExecutor(cfg.loader_threads)
    start = time.perf_counter()

    async def one(s):
        async with sem:
            try:
                p = await loop.run_in_executor(pool, load, s)
                t0 = time.perf_counter()
                try:
                    async for out in engine.generate(
                        data.vllm_input(p), sp, request_id=f"{bench}:{s['id']}"
                    ):
                        pass
                finally:
                    spans.append((t0, time.perf_counter()))
            # any sample-level failure is reported, the run goes on
            except Exception as e:  # noqa: BLE001
                write(s, "", "", failure(s, e))
                return
        write(s, p.text, out.outputs[0].text)

    await asyncio.gather(*(one(s) for s in samples))
    pool.shutdown()
    wall = max(time.perf_counter() - start, 1e-9)
    return {
        "engine_busy": union_length(spans) / wall,
        "mean_in_flight": sum(t1 - t0 for t0, t1 in spans) / wall,
    }


def union_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the (start, end) spans: the time the engine had a request."""
    total = 0.0
    reach = -math.inf  # the end of the union so far
    for t0, t1 in sorted(spans):
        total += max(0.0, t1 - max(t0, reach))
        reach = max(reach, t1)
    return total


def run_sync(engine, samples: list, load, cfg: Config, write) -> dict:
    """The plain loop: load a batch (decode or cache), generate, wait, repeat (rollout.VLLMEngine or
    HFEngine)."""
    for i in range(0, len(samples), cfg.batch_size):
        ok = []
        for s in samples[i : i + cfg.batch_size]:
            try:
                ok.append(load(s))
            except Exception as e:  # noqa: BLE001 - reported and counted, the run goes on
                write(s, "", "", failure(s, e))
        if ok:
            for p, r in zip(ok, engine.generate(ok, 1, cfg.temperature, cfg.max_tokens, cfg.seed)):
                write(p.sample, p.text, r.text)
    return {}


def judge_rule(judge, row: dict):
    """The judge rule of a row: the benchmark's, or (a mapping by question type: MLVU) its type's."""
    if isinstance(judge, dict) and "user" not in judge:
        return judge.get(str(row.get("question_type")))
    return judge


def judge_messages(rule, row: dict) -> list[dict]:
    """The judge's conversation for a row: a rule's user text ({question}, {answer}, {pred}) after
    its system text, if any."""
    fill = {
        "answer": row["target"],
        "pred": row["filtered_resps"][0] or row["resps"][0],
        "question": row.get("question", ""),
    }
    if isinstance(rule, str):
        rule = {"user": rule}
    msgs = [{"role": "user", "content": rule["user"].format(**fill)}]
    if rule.get("system"):
        msgs.insert(0, {"role": "system", "content": rule["system"]})
    return msgs


def judge_verdict(text: str, rule) -> dict:
    """The row fields a judge's reply sets: score in [0, 1] and parse_fail; a rubric's rows also its
    summed scores (judge_score), and a reply Video-MMLU's scorer skips, dropped."""
    if isinstance(rule, str):  # EasyVideoR1's llm_judge.py: the last "Judgement: 0/1"
        v = re.findall(r"Judgement\s*:\s*([01])", text)
        return {"score": float(v[-1]) if v else 0.0, "parse_fail": not v}
    if rule.get("verdict"):
        # Video-MMLU eval_reason_qa.py: the reply is a dict literal, else the sample is skipped
        try:
            verdict = ast.literal_eval(text.strip()[:10_000])
            total = sum(float(verdict[k]) for k in rule["keys"])
            right = str(verdict[rule["verdict"]]).lower() == "yes"
        except (ValueError, TypeError, KeyError, SyntaxError, RecursionError, MemoryError):
            return {"score": 0.0, "parse_fail": True, "dropped": True}
        return {"score": float(right), "parse_fail": False, "judge_score": total}
    # MLVU calculate.py extract_scores: each key's number from its next ":" + 2 to the next ","; a
    # key not found adds 0 (its try/except), a number that does not parse ends the reading here
    values = []
    for k in rule["keys"]:
        start = text.find(k)
        if start == -1:
            continue
        at = text.find(":", start) + 2
        try:
            values.append(float(text[at : text.find(",", at)]))
        except ValueError:
            break
    total = sum(values)
    return {
        "score": total / (5 * len(rule["keys"])),
        "parse_fail": len(values) < len(rule["keys"]),
        "judge_score": total,
    }


def ask_judge(cfg: Config, conversations: list[list[dict]]) -> list[rewards.Verdict]:
    """The judge's replies (Verdict.reply; .error and .detail for a request that failed), greedy
    (EasyVideoR1 uses T=0.1; MLVU and Video-MMLU 0): served at judge_url (the training reward's
    client, rewards.Judge), else a vLLM engine on cfg.judge_model, started for this and dropped
    after. The one place a judge is called."""
    if cfg.judge_url:
        settings = rewards.JudgeSettings(
            judge_url=cfg.judge_url, judge_model=cfg.judge_model, judge_max_tokens=1024
        )
        keys = [rewards.JudgeItem(json.dumps(c), "", "") for c in conversations]  # the cache's key
        return rewards.Judge(settings)(keys, conversations)
    from vllm import LLM, SamplingParams

    from rollout import start_errors, vllm_settings

    # the evaluated model's engine settings (on CPU: its fixed KV cache, not a share of free memory)
    with start_errors(cfg.max_model_len):
        llm = LLM(**vllm_settings(cfg.judge_model, **engine_args(cfg, 0)))
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=1024), use_tqdm=False)
    return [rewards.Verdict(None, reply=o.outputs[0].text) for o in outs]


def judge_rows(rows: list[dict], cfg: Config, judge) -> str:
    """Rescore the rows marked for the judge by their rule (judge_rule); who judged."""
    todo = [r for r in rows if r.get("judge") == "none" and not r["error"]]
    if todo and cfg.judge_model:
        rules = [judge_rule(judge, r) for r in todo]
        replies = ask_judge(cfg, [judge_messages(rule, r) for rule, r in zip(rules, todo)])
        for r, rule, v in zip(todo, rules, replies):
            r.update(judge_verdict(v.reply, rule), judge=cfg.judge_model, judge_reply=v.reply)
            if v.error == "judge_error":  # no reply: counted apart from an unreadable one
                r["judge_error"] = v.detail
    if not any("judge" in r for r in rows):
        return "not needed"
    return cfg.judge_model or "none: open-ended items scored by rule (ROUGE/exact), not the judge"


def make_engine(cfg: Config, tokenizer):
    """cfg.engine's: AsyncLLM (async), rollout.VLLMEngine (sync) or rollout.HFEngine (hf)."""
    from rollout import HFEngine, VLLMEngine, eos_token_ids, start_errors, vllm_settings

    if cfg.engine == "hf":
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(
            cfg.model,
            config=common.hf_config(cfg.model, cfg.trust_remote_code),
            dtype="float32",
            trust_remote_code=cfg.trust_remote_code,
        ).eval()
        return HFEngine(model, tokenizer, eos_token_ids(model))
    if cfg.engine == "sync":
        return VLLMEngine(cfg.model, tokenizer, sleep=False, **engine_args(cfg, 1))
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        **vllm_settings(cfg.model, **engine_args(cfg, 1)),
        enable_chunked_prefill=True,
        data_parallel_size=cfg.data_parallel_size,
    )
    with start_errors(cfg.max_model_len):
        return AsyncLLM.from_engine_args(args)


def engine_args(cfg: Config, media: int) -> dict:
    """cfg's engine fields as rollout.VLLMEngine and rollout.vllm_settings take them, `media`
    images and videos a prompt."""
    return dict(
        tp=cfg.tensor_parallel_size,
        seed=cfg.seed,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_images=media,
        max_videos=media,
        trust_remote_code=cfg.trust_remote_code,
    )


# the fields of a resume log's row that aggregate() reads, and their types
LOG_FIELDS = {"doc_id": str, "score": (int, float), "parse_fail": bool, "error": str}


def read_log(path: str) -> tuple[dict, int]:
    """Finished rows of an earlier run by doc_id, and the number of torn lines (a crash mid-write)
    dropped. A row that parses but lacks a field aggregate() reads (an edited or foreign log) is a
    DataError naming file:line and field."""
    done = {}
    torn = 0
    if not os.path.exists(path):
        return done, torn
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                torn += 1
                continue
            for k, kind in LOG_FIELDS.items():
                if not isinstance(r, dict) or not isinstance(r.get(k), kind):
                    raise DataError(
                        f"{path}:{n}: resume row without a valid field {k!r} (delete it to redo it)"
                    )
            done[r["doc_id"]] = r
    return done, torn


def resolve(cfg: Config) -> Config:
    """Fill the defaults that depend on other settings; refuse settings that cannot fit, before
    anything loads."""
    from rollout import model_spec

    model = os.path.realpath(cfg.model)
    spec = model_spec(cfg.model) or {}  # config.json (a hub model's: its published values)
    positions = spec.get("text_config", spec).get("max_position_embeddings", 16384)
    # the model's own limit, not the user's choice
    capped = not cfg.max_model_len and positions < 16384
    max_model_len = cfg.max_model_len or min(16384, positions)
    digest = hashlib.sha1(model.encode()).hexdigest()[:8]
    out_dir = os.path.join("runs", "eval", f"{os.path.basename(model)}-{digest}")
    cfg = replace(
        cfg,
        out_dir=cfg.out_dir or out_dir,
        max_model_len=max_model_len,
        max_prompt_len=cfg.max_prompt_len or max_model_len - cfg.max_tokens,
    )
    # vision tokens of the largest video: frame pairs x pixels / 28^2 (Qwen2/2.5-VL; Qwen3-VL's 32^2
    # gives fewer)
    frames = cfg.video_max_frames * cfg.video_max_pixels
    tokens = min(frames, cfg.video_total_pixels or frames) // (2 * 28 * 28)
    if tokens + 256 > cfg.max_prompt_len:
        msg = (
            f"a video can take {tokens} vision tokens ({cfg.video_max_frames} frames x "
            f"{cfg.video_max_pixels} pixels) but max_prompt_len is {cfg.max_prompt_len}: raise "
            "--max-model-len or lower --video-max-frames / --video-max-pixels / "
            "--video-total-pixels"
        )
        if not capped:
            raise UserError(msg)
        data.warn(
            f"warning: {msg} (the model has {positions} positions; "
            "longer videos fail one by one, reported)"
        )
    return cfg


@dataclass
class Job:
    """One benchmark, loaded and checked, before any engine starts."""

    samples: list[dict]
    """the samples to evaluate (those whose media exist)"""
    missing: list[dict]
    """the samples whose media are missing (listed in bad)"""
    skipped: list[dict]
    """{where, error} of each record without ground truth"""
    bad: list[dict]
    """{where, error} of each record that could not be read, and of each sample in missing"""
    run: dict
    """the settings that change its answers, as run.json holds them"""
    done: dict
    """the rows of the resume log by doc_id"""
    torn: int
    """torn lines (a crash mid-write) dropped from the resume log"""
    folder: str
    """out_dir/<benchmark>: samples.jsonl (the resume log) and run.json"""
    cfg: Config
    """its settings (with_audio: the soundtracks where its official setting sends them)"""


def with_audio(cfg: Config, bench: str) -> Config:
    """cfg for one benchmark: each video's soundtrack (video_audio) where its official setting sends
    it (benchmarks.yaml `audio`) and the model hears (Omni); a deaf model goes without, warned."""
    from rollout import model_spec

    if not adapter(bench).get("audio") or cfg.video_audio:
        return cfg
    if "thinker_config" not in (model_spec(cfg.model) or {}):
        data.warn(
            f"warning: {bench}: its official setting sends the soundtracks; {cfg.model} hears none"
        )
        return cfg
    return replace(cfg, video_audio=True)


def prepare_benchmark(bench: str, cfg: Config) -> Job:
    """Load, check and resume one benchmark before any engine starts: samples, failures, rows
    already done."""
    cfg = with_audio(cfg, bench)
    skipped = []
    bad = []
    samples = load_benchmark(bench, cfg, skipped, bad)
    template = adapter(bench).get("prompt")
    if template:  # bounded in time and memory as training's templates; a failure names both
        samples = data.render_all(template, samples, where=f"{BENCHMARKS}: {bench}")
    absent = {s["id"]: data.missing_media(s) for s in samples}  # a stat a file, before any engine
    missing = [s for s in samples if absent[s["id"]]]
    bad += [
        {"where": s["where"], "error": f"sample {s['id']}: missing media {absent[s['id']]}"}
        for s in missing
    ]
    if missing:  # one line now, not a surprise in results.json hours later
        first = "; ".join(f"{s['where']}: {absent[s['id']][0]}" for s in missing[:3])
        data.warn(
            f"warning: {bench}: {len(missing)} samples name a media file that is missing or not a "
            f"regular file ({first}{', ...' if len(missing) > 3 else ''}): not evaluated, counted "
            "unevaluable (exit 1 unless --allow-failures)"
        )
    folder = os.path.join(cfg.out_dir, bench)
    run = {
        "model": os.path.realpath(cfg.model),
        "benchmark": bench,
        **{f.name: getattr(cfg, f.name) for f in fields(cfg) if "answers" in f.metadata},
    }
    done, torn = read_log(os.path.join(folder, "samples.jsonl"))
    old = {}
    saved = os.path.join(folder, "run.json")
    if done and os.path.exists(saved):
        with open(saved, encoding="utf-8") as f:
            old = json.load(f)
    if done and old != run:
        diff = sorted(k for k in {**old, **run} if old.get(k) != run.get(k))
        raise DataError(
            f"{folder}/samples.jsonl holds answers of another run (differs in {', '.join(diff)}: "
            f"{ {k: old.get(k) for k in diff} }); refusing to resume: pick another --out-dir or "
            "delete it"
        )
    return Job(
        samples=[s for s in samples if s not in missing],
        missing=missing,
        skipped=skipped,
        bad=bad,
        run=run,
        done=done,
        torn=torn,
        folder=folder,
        cfg=cfg,
    )


def shut_down(timeout: float | None = None):
    """An engine's shutdown once it has run."""


async def evaluate(cfg: Config, engine=None, processor=None) -> dict:
    """Check every benchmark, then run, judge, aggregate each, rewriting results.json/.md; an engine
    given is kept."""
    cfg = resolve(cfg)
    # every check before the engine starts, the model's first (a mistyped path is no benchmark's fault)
    if processor is None:
        common.check_hub(cfg.model)
    jobs = {b: prepare_benchmark(b, cfg) for b in cfg.benchmarks.split(",")}
    if processor is None:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(
            cfg.model, trust_remote_code=cfg.trust_remote_code
        )
    own = engine is None
    results = {}
    if own:
        engine = make_engine(cfg, processor.tokenizer)
    try:
        for bench, job in jobs.items():
            try:
                results[bench] = await run_benchmark(bench, job, cfg, engine, processor)
            # a broken benchmark does not cost the others their results
            except Exception as e:  # noqa: BLE001
                results[bench] = {
                    "error": f"{type(e).__name__}: {e}",
                    "unevaluable": len(job.samples),
                }
                data.warn(f"{bench}: FAILED {results[bench]['error']}")
            write_results(results, cfg)
    finally:
        if own and hasattr(engine, "close"):  # rollout's engines (sync, hf)
            engine.close()
        elif own:
            # AsyncLLM's engine core, now. vLLM keeps a frame that holds the engine to interpreter
            # exit, where __del__'s second shutdown would find vLLM's globals gone: a traceback
            engine.shutdown()
            engine.shutdown = shut_down
    print(f"results: {os.path.join(cfg.out_dir, 'results.json')}", flush=True)
    return results


async def run_benchmark(bench: str, job: Job, cfg: Config, engine, processor) -> dict:
    """Generate what the resume log lacks, each row scored and appended as it finishes; judge;
    aggregate."""
    samples = job.samples
    done = job.done
    path = os.path.join(job.folder, "samples.jsonl")
    write_jsonl(path, list(done.values()))  # drop torn lines before appending
    write_text(os.path.join(job.folder, "run.json"), json.dumps(job.run, indent=1))
    todo = [s for s in samples if s["id"] not in done]
    before = len(done)
    start = time.perf_counter()
    last = start  # when progress was last printed
    guess_seed = None
    if cfg.random_fallback:
        guess_seed = cfg.seed
    load, load_stats = make_loader(processor, job.cfg, bench)
    with open(path, "a", encoding="utf-8") as fh:

        def write(s: dict, prompt: str, response: str, error: str = ""):
            nonlocal last
            r = record(s, bench, prompt, response, error, guess_seed, cfg.answer_extraction)
            fh.write(json.dumps(r) + "\n")
            fh.flush()
            done[r["doc_id"]] = r
            n = len(done) - before  # each row is a new doc_id
            now = time.perf_counter()
            if now - last > 10 or n == len(todo):  # done/total, rate and ETA on stderr
                last = now
                rate = n / (now - start)
                eta = (len(todo) - n) / rate
                data.warn(f"{bench}: {n}/{len(todo)} | {rate:.2f} samples/s | ETA {eta:.0f} s")

        if cfg.engine == "async":
            engine_stats = await run_async(
                engine, todo, load, cfg, bench, write, processor.tokenizer
            )
        else:
            engine_stats = run_sync(engine, todo, load, cfg, write)
    rows = [done[s["id"]] for s in samples]  # sample order, one row per doc_id
    judge = judge_rows(rows, cfg, adapter(bench).get("judge"))
    write_jsonl(path, rows)
    failed = job.bad + [{"where": r["doc_id"], "error": r["error"]} for r in rows if r["error"]]
    res = {
        "metrics": aggregate(rows, bench),
        "unevaluable": len(failed),
        "failed_samples": failed,
        "no_ground_truth": len(job.skipped),
        "resumed": len(samples) - len(todo),
        "torn_lines": job.torn,
        "seconds": round(time.perf_counter() - start, 3),
        "samples": path,
        "judge": judge,
        "frames": {k: sum(s.get(k, 0) for s in load_stats) for k in ("cache_hit", "decode")},
        **engine_stats,
    }
    shown = [
        f"{k} {number(v)}" for k, v in res["metrics"].items() if "/" not in k and k != "failed"
    ]
    print(f"{bench}: {' | '.join(shown)} | unevaluable {len(failed)}", flush=True)
    return res


def number(v) -> str:
    """A count (n, parse_fail, dropped) as a count, a score in percent with 2 decimals."""
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def write_results(results: dict, cfg: Config):
    """results.json (settings and every benchmark's result) and results.md (the table), both
    rewritten whole."""
    write_text(
        os.path.join(cfg.out_dir, "results.json"),
        json.dumps({"settings": asdict(cfg), "benchmarks": results}, indent=1),
    )
    lines = [
        f"model `{cfg.model}`, engine {cfg.engine}, temperature {cfg.temperature}, "
        f"max_tokens {cfg.max_tokens}, fps {cfg.video_fps}, "
        f"frames {cfg.video_min_frames}-{cfg.video_max_frames}, "
        f"max_pixels {cfg.video_max_pixels}, random_fallback {cfg.random_fallback}",
        "",
        "| benchmark | metric | value |",
        "|---|---|---|",
    ]
    for b, r in results.items():
        if "error" in r:
            lines.append(f"| {b} | FAILED | {r['error']} |")
            continue
        # failed (no answer) is part of unevaluable (no answer, or no input), the row below
        lines += [f"| {b} | {k} | {number(v)} |" for k, v in r["metrics"].items() if k != "failed"]
        lines.append(f"| {b} | unevaluable (not scored) | {r['unevaluable']} |")
        if r["judge"] != "not needed":
            lines.append(f"| {b} | judge | {r['judge']} |")
    write_text(os.path.join(cfg.out_dir, "results.md"), "\n".join(lines) + "\n")


def main(cfg: Config) -> int:
    """Run, then exit 1 when any sample or benchmark could not be evaluated (unless
    allow_failures)."""
    # bad settings or inputs: common.cli prints the one-line error
    if cfg.judge_url and not cfg.judge_model:
        raise UserError("judge_url needs judge_model (the name the server serves)")
    results = asyncio.run(evaluate(cfg))
    failures = sum(r.get("unevaluable", 0) for r in results.values())
    if failures:
        data.warn(
            f"{failures} samples could not be evaluated "
            "(listed under failed_samples in results.json, not scored)"
        )
    return 1 if failures and not cfg.allow_failures else 0


if __name__ == "__main__":
    sys.exit(common.cli(main, load_config))
elif __name__ == "__mp_main__":
    # vLLM's engine and worker processes (spawned) run this file first: quiet there too
    common.quiet()

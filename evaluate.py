"""evaluate.py: video benchmarks with their official metrics, on vLLM's asynchronous engine.

    python evaluate.py --model DIR --benchmarks videomme,mvbench,vsibench --data-dir ANN --video-dir VID
    python evaluate.py --model DIR --benchmarks nvr1 --data-dir .cache/data/color   # our own schema (val.jsonl)

Annotations are read in each benchmark's official format from {data_dir}/{name}.json|.jsonl (or a folder of
them, e.g. MVBench's json/<task>.json), videos from {video_dir}/{name}/. Pipeline (engine="async"): loader
threads read frames (cache.load_video via data.prepare, cached or decoded) and the chat prompt, and hand each
request to AsyncLLM as soon as it is ready; at most max_in_flight samples are loaded or generating at any time,
so memory stays flat; each result is scored and appended to {out_dir}/{name}/samples.jsonl the moment it
finishes. A rerun skips every doc_id already there (resumable: a crash loses nothing). engine="sync" is the
colocated rollout.VLLMEngine (what train.py has), engine="hf" transformers generate (no vLLM).

An adapter is a dict: how to read an official record (question/options/answer/video fields, options inline in
the question when opts is None), the prompt (sandboxed Jinja2 over the sample), and the official aggregate
(breakdown keys, macro means, grounding recalls, grouped scores). Scorers are rewards.py's. Open-ended items of
judge benchmarks go to an LLM judge (judge_model); without one they are scored by rewards' rule (ROUGE/exact)
and results.json says so. Deviations: unparseable answers score 0 (never a random option), audio/subtitles
are not used, MVBench STAR/STA clips are not cut to [start, end], Video-MME-v2 logic-chain scores are missing.
"""
import asyncio
import copy
import glob
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import cache
import data
import rewards
from data import DataError


@dataclass
class Config:
    model: str = ".cache/models/tiny-qwen2_5_vl"
    """HF model folder (Qwen2-VL, Qwen2.5-VL or Qwen3-VL)"""
    benchmarks: str = "nvr1"
    """comma-separated adapter names (see ADAPTERS)"""
    data_dir: str = "data/benchmarks"
    """annotation files: {data_dir}/{name}.json, .jsonl or a folder of them"""
    video_dir: str = "data/videos"
    """videos: {video_dir}/{name}/<the path the record names>"""
    out_dir: str = "runs/eval"
    """results.json, results.md and {name}/samples.jsonl (the resume log)"""
    engine: str = "async"
    """async (vLLM AsyncLLM pipeline) | sync (colocated vLLM LLM, batch by batch) | hf (transformers generate)"""
    max_samples: int = 0
    """per benchmark, the first N samples (0 = all)"""
    max_tokens: int = 64
    """response budget (EasyVideoR1 uses 2048 with thinking)"""
    temperature: float = 0.0
    """0 = greedy (deterministic)"""
    seed: int = 0
    """sampling seed"""
    max_in_flight: int = 64
    """samples loaded or generating at once (the bound on memory)"""
    loader_threads: int = 2
    """threads reading frames and building prompts"""
    batch_size: int = 16
    """sync/hf engines: prompts per generate call"""
    max_model_len: int = 4096
    """vLLM context length"""
    dtype: str = "auto"
    """vLLM dtype"""
    judge_model: str = ""
    """HF folder of an LLM judge for open-ended items ('' = rule-based fallback, reported as such)"""
    trust_remote_code: bool = False
    """let transformers/vLLM run code shipped with the checkpoint"""
    max_prompt_len: int = 4096
    """longer prompts are an error for that sample (counted in failed), never truncated"""
    video_fps: float = 2.0
    """frames per second of video"""
    video_min_frames: int = 4
    """at least this many frames"""
    video_max_frames: int = 64
    """at most this many frames"""
    video_min_pixels: int = 3136
    """min pixels per frame"""
    video_max_pixels: int = 262144
    """max pixels per frame"""
    video_total_pixels: int = 0
    """pixel budget over all frames of a video (0 = none)"""
    image_min_pixels: int = 3136
    """min pixels per image"""
    image_max_pixels: int = 1003520
    """max pixels per image"""
    max_decode_pixels: int = cache.MAX_DECODE_PIXELS
    """videos and images with more pixels per frame are refused before decoding (default: 8K, 7680x4320)"""
    video_source: str = "prefer_cache"
    """prefer_cache | cache_only | decode_only (cache.py)"""
    cache_dir: str = ".cache/frames"
    """frame cache folder ('' = none)"""


# ---------------------------------------------------------------------------------------------------
# adapters: official record -> data.py sample; prompt; aggregate
LETTER = "\nAnswer with the option's letter from the given choices directly."
OPTS = "{{ options | join('\n') }}"
P_MC = "{{ problem }}\n" + OPTS + LETTER
P_EVR1 = ("{% if options %}Select the best answer to the following multiple-choice question based on the video.\n"
          "Respond with only the letter (A, B, C, or D) of the correct option.\nQuestion: {{ problem }} Possible answer "
          "choices:\n" + OPTS + "\n{% else %}Answer the following question based on the video.\nQuestion: {{ problem }}"
          "{% endif %}{% if 'grounding' in problem_type %}\nPlease provide the time span in seconds as JSON within the "
          '<answer>...</answer> tags.\nExample:\n<answer>{"time": [12.3, 25.7]}</answer>\n{% if problem_type != '
          "'temporal grounding' %}Also give one box per integer second: \"boxes\": {\"<sec>\": [x1, y1, x2, y2]}.\n"
          "{% endif %}{% endif %}\nThe best answer is: ")
EVR1 = dict(q="problem", opts="options", ans="solution", id="problem_id", video="{path}", prompt=P_EVR1,
            ptype=lambda r: {"REC": "counting", "SSR": "boolean", "CRR": "boolean"}.get(r["problem_type"], r["problem_type"]))
VSI_NA = ("object_counting", "object_abs_distance", "object_size_estimation", "room_size_estimation")
A = dict  # one adapter


def judge_type(r, key, mc_value):  # MC or open-ended (judged) by one field's value
    return "multiple choice" if r.get(key) == mc_value else "open-ended"


ADAPTERS = {
    "nvr1": A(own=True, keys=("problem_type",)),  # data.py's schema and prompts: the training validation set
    "videomme": A(q="question", opts="options", ans="answer", id="question_id", video="{videoID}.mp4",
                  keys=("duration", "domain", "task_type"), prompt="Select the best answer to the following "
                  "multiple-choice question based on the video. Respond with only the letter (A, B, C, or D) of the "
                  "correct option.\nQuestion: {{ problem }}\n" + OPTS + "\nThe best answer is:"),
    "videomme_v2": A(q="question", opts="options", ans="answer", video="{video_id}.mp4", keys=("level",), group="group_id",
                     prompt="Question: {{ problem }}\n" + OPTS + "\nSelect the best answer to the following multiple-"
                     "choice question based on the video. Respond with only the letter (A, B, C, D, E, F, G, or H) of the correct option."),
    "mvbench": A(q="question", opts="candidates", ans="answer", video="{video}", keys=("task",), macro=("task",),
                 fix=lambda r: {"task": r["_file"]},
                 prompt="Carefully watch the video and pay attention to the cause and sequence of events, the detail and "
                 "movement of objects, and the action and pose of persons. Based on your observations, select the best "
                 "option that accurately addresses the question.\nQuestion: {{ problem }}\nOptions:\n{% for o in options %}"
                 "({{ o[0] }}) {{ o[3:] }}\n{% endfor %}Only give the best option."),
    "tempcompass": A(q="question", opts=None, ans="answer", video="{video_id}.mp4", keys=("dim", "format"),
                     fix=lambda r: {"format": r["_file"]}, judge=True,
                     ptype=lambda r: ("boolean" if str(r["answer"]).lower() in ("yes", "no") else
                                      "open-ended" if r["_file"] == "captioning" else "multiple choice"),
                     prompt="{{ problem }}{% if problem_type == 'boolean' %}\nPlease answer yes or no:{% elif problem_type "
                     "== 'multiple choice' %}\nPlease directly give the best option:{% endif %}"),
    "motionbench": A(nested="qa", q="question", opts=None, ans="answer", id="uid", video="{video_path}", keys=("question_type",),
                     prompt="{{ problem }}\nAnswer with only the option letter (A, B, C, D, E, or F)."),
    "lvbench": A(nested="qa", q="question", opts=None, ans="answer", id="uid", video="{key}.mp4", keys=("question_type",),
                 prompt="{{ problem }}\nAnswer the question with the option letter"),
    "longvideobench": A(q="question", opts=tuple(f"option{i}" for i in range(5)), ans="correct_choice", id="id",
                        video="{video_path}", keys=("duration_group", "question_category"), prompt=P_MC),
    "mlvu": A(q="question", opts=None, ans="answer", video="{video_name}", keys=("task_type",), macro=("task_type",),
              prompt="{{ problem }}\nOnly give the best option.\nBest option: ("),
    "holmes": A(q="Question", opts="Options", ans="Answer", video="{video ID}.mp4", keys=("Question Type",),
                prompt="Question: {{ problem }}\n" + OPTS + "\nSelect the best answer to the following multiple-choice "
                "question based on the video. Respond with only the letter (A, B, C, D, E, or F) of the correct option."),
    "minerva": A(q="question", opts=tuple(f"answer_choice_{i}" for i in range(5)), ans="answer_id", video="{video_id}.mp4",
                 prompt=P_MC),
    "vcrbench": A(q="question", opts="choices", ans="answer", id="id", video="{video_path}", keys=("dimension",), judge=True,
                  ptype=lambda r: judge_type(r, "multiple-choice", True),
                  prompt="Please analyze the video and answer the question about its content.\nQuestion: {{ problem }}\n"
                  "{% if options %}" + OPTS + "\n{% endif %}Answer: "),
    "videoreasonbench": A(EVR1, keys=("data_source",), judge=True, after="Final Answer", prompt="{{ problem }}"),
    "longvideoreason": A(EVR1),
    "mmvu": A(q="question", opts="choices", ans="answer", id="id", video="{subject}/{file}", keys=("question_type", "subject"),
              judge=True, ptype=lambda r: judge_type(r, "question_type", "multiple-choice"),
              fix=lambda r: dict(zip(("subject", "file"), r["video_path"].split("/")[-2:])),  # a hub URL
              prompt="\nQuestion:{{ problem }}\n" + OPTS + "\nVisual Information: processed video\nDo not generate any "
              "intermediate reasoning process. {% if options %}Answer directly with the option letter from the\ngiven "
              "choices.{% else %}Directly output the final answer.{% endif %}\n"),
    "videommmu": A(q="question", opts="options", ans="answer", id="id", video="{id}.mp4", keys=("track", "discipline"),
                   fix=lambda r: {"track": r["_file"], "discipline": r["id"].split("_")[1]},
                   ptype=lambda r: "multiple choice" if r["question_type"] == "multiple-choice" else "numerical",
                   prompt="{{ problem }}\n" + OPTS + "\nPlease ignore the Quiz question in last frame of the video."),
    "videomathqa": A(q="question", opts="options", ans="answer", id="question_id", video="{videoID}.mp4",
                     keys=("category", "length"), prompt="Select the best answer to the following multiple-choice question "
                     "based on the video. Respond with the letter (A, B, C, D or E) of the correct option.\n{{ problem }}\n"
                     + OPTS + "\n\nAnswer with the option's letter (A, B, C, D or E) from the given choices directly."),
    "vsibench": A(q="question", opts="options", ans="ground_truth", id="id", video="{dataset}/{scene_name}.mp4",
                  keys=("category",), macro=("category",),  # overall: mean of 8 categories, rel_direction pre-averaged
                  fix=lambda r: {"category": re.sub(r"_(easy|medium|hard)$", "", r["question_type"])},
                  ptype=lambda r: "regression" if r["question_type"] in VSI_NA else "multiple choice",
                  prompt="These are frames of a video.\n{{ problem }}\n{% if options %}Options:\n" + OPTS + LETTER +
                  "{% else %}\nPlease answer the question using a single word or phrase.{% endif %}"),
    "charades_sta": A(q="problem", opts=None, ans="answer", video="{video}", tiou=True, ptype="temporal grounding",
                      fix=lambda r: {"answer": json.dumps({"time": r["timestamp"]}), "problem": "Please find the visual "
                                     f"event described by the sentence '{r['caption']}', determining its starting and ending times."},
                      prompt=P_EVR1),
    "stvg": A(EVR1, tiou=True),
    "ovobench": A(EVR1, keys=("ovo_category", "ovo_task"), macro=("ovo_category", "ovo_task"),
                  fix=lambda r: {"solution": ("yes" if str(r.get("ovo_type")) == "1" else "no")}
                  if r["problem_type"] in ("SSR", "CRR") else {}),
    "odvbench": A(EVR1, keys=("odv_task", "odv_subtask")),
    "livesports3k_qa": A(EVR1, keys=("q_type_livesports", "ocr_livesports")),
    "egoschema": A(q="question", opts="option", ans="answer", id="question_idx", video="{video_idx}.mp4", prompt=P_MC),
    "nextqa": A(q="question", opts=tuple(f"a{i}" for i in range(5)), ans="answer", video="{video}.mp4", keys=("type",),
                prompt="{{ problem }}\n" + OPTS),
    "perceptiontest": A(q="question", opts="options", ans="answer_id", id="question_id", video="{video_name}.mp4",
                        keys=("area", "reasoning"), prompt=P_MC),
    "worldsense": A(q="question", opts="candidates", ans="answer", id="index", video="{video_path}",
                    keys=("task_domain", "task_type", "duration", "audio_class"),
                    prompt="Carefully watch this video and pay attention to every detail. Based on your observations, "
                    "select the best option that accurately addresses the question.\n{{ problem }}\n" + OPTS +
                    "\nRespond with only the letter (A, B, C, or D) of the correct option."),
}
_LETTERED = re.compile(r"\s*\(?[A-Z][.):]")


def read_rows(path: str) -> list[tuple[str, dict]]:
    """(where, record) from a .json array, a .jsonl, or a folder of them; record["_file"] is the file's stem."""
    files = sorted(glob.glob(os.path.join(path, "*.json*"))) if os.path.isdir(path) else [path]
    out = []
    for f in files:
        stem = os.path.basename(f).split(".")[0]
        with open(f, encoding="utf-8") as fh:
            rows = json.load(fh) if f.endswith(".json") else [json.loads(x) if x.strip() else None for x in fh]
        out += [(f"{f}:{i + 1}", dict(r, _file=stem)) for i, r in enumerate(rows) if r is not None]
    return out


def to_sample(r: dict, ad: dict, where: str, video_root: str) -> dict | None:
    """One official record -> a validated data.py sample (None: no ground truth, e.g. EgoSchema's hidden test)."""
    try:
        r = {**r, **ad.get("fix", lambda _: {})(r)}
        q, ans = str(r[ad["q"]]), r[ad["ans"]]
        opts = ad["opts"]
        raw = ([r[k] for k in opts if r.get(k) not in (None, "", "N/A")] if isinstance(opts, tuple) else
               r[opts] or [] if opts else [ln for ln in q.split("\n") if _LETTERED.match(ln)])  # inline: from the question
        raw = raw.split("\n") if isinstance(raw, str) else [f"{k}. {v}" for k, v in raw.items()] if isinstance(raw, dict) else raw
        lettered = all(_LETTERED.match(o) for o in raw)
        options = [o.strip() for o in raw] if lettered else [f"{chr(65 + i)}. {o}" for i, o in enumerate(raw)]
        if ans is None or str(ans).strip() in ("", "NA", "None"):
            return None
        if isinstance(ans, int) and not isinstance(ans, bool) and options:
            ans = chr(65 + ans)  # an option index
        elif not lettered and ans in raw:
            ans = chr(65 + raw.index(ans))  # the text of the right candidate (MVBench)
        pt = ad.get("ptype", "multiple choice")
        pt = pt(r) if callable(pt) else pt
        video = os.path.join(video_root, ad["video"].format(**r))
        sid = str(r.get(ad.get("id"), where.rsplit("/", 1)[-1])) if ad.get("id") in r else f"{r['_file']}:{where.rsplit(':', 1)[1]}"
    except KeyError as e:
        raise DataError(f"{where}: missing field {e}") from e
    s = {"id": sid, "problem": q, "answer": str(ans), "problem_type": pt, "options": options if pt == "multiple choice" else [],
         "videos": [video], **{k: r[k] for k in ad.get("keys", ()) if k in r}}
    return data.validate_sample(s, where)


def load_benchmark(name: str, cfg: Config, skipped: list) -> list[dict]:
    ad = ADAPTERS[name]
    path = next((p for p in (os.path.join(cfg.data_dir, name + e) for e in (".jsonl", ".json", "")) if os.path.exists(p)), None)
    if path is None:
        raise FileNotFoundError(f"{name}: no annotations at {cfg.data_dir}/{name}[.json|.jsonl]")
    if ad.get("own"):
        return data.load_samples(path if os.path.isfile(path) else os.path.join(path, "val.jsonl"))[:cfg.max_samples or None]
    rows = read_rows(path)
    if ad.get("nested"):  # one record per video holding its questions (LVBench, MotionBench)
        rows = [(w, {**r, **qa}) for w, r in rows for qa in r[ad["nested"]]]
    out = []
    for where, r in rows:
        s = to_sample(r, ad, where, os.path.join(cfg.video_dir, name))
        out.append(s) if s else skipped.append({"where": where, "error": "no ground truth"})
    return out[:cfg.max_samples or None]


# ---------------------------------------------------------------------------------------------------
# scoring (rewards.py's scorers) and official aggregates
_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(?:s|sec|seconds)?\s*(?:-|–|to)\s*(\d+(?:\.\d+)?)")


def score(response: str, s: dict, ad: dict) -> tuple[str | None, float | None]:
    """(parsed answer, score in [0, 1]); score None = unparseable (counted, scored 0)."""
    t = rewards.canonical_type(s["problem_type"])
    text = (response or "")[-rewards.MAX_LEN:]  # the answer is at the end
    if ad.get("after") and (k := text.rfind(ad["after"])) >= 0:
        text = text[k + len(ad["after"]):].lstrip(" :*")
    ans = rewards.extract_answer(text) or text.strip()  # eval prompts ask for a bare letter/number: no tags
    if t == "temporal grounding" and rewards.as_span(rewards.parse_json(ans)) is None and (m := _SPAN.search(ans)):
        ans = json.dumps({"time": sorted(float(x) for x in m.groups())})  # "12.3 - 25.7 seconds" (lmms-eval style)
    try:
        if t == "regression":  # the official VSI-Bench MRA compares with <=
            p = rewards.parse_number(ans)
            v = None if p is None else rewards.mra(p, rewards.parse_number(rewards.ground_truth(s)), inclusive=True)
        else:
            v = rewards.ACCURACY.get(t, rewards.acc_open)(ans, s)
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, RecursionError, OverflowError):
        v = None
    parsed = rewards.choice_letter(ans, s["options"]) if t == "multiple choice" else ans
    return (parsed if v is not None else None), v


def record(s: dict, bench: str, prompt: str, response: str, error: str = "") -> dict:
    """One per-sample line, lmms-eval field names (doc_id, input, target, resps, filtered_resps) + score."""
    ad = ADAPTERS[bench]
    parsed, v = score(response, s, ad) if not error else (None, None)
    return {"doc_id": s["id"], "input": prompt, "target": rewards.ground_truth(s), "resps": [response],
            "filtered_resps": [parsed], "score": float(v or 0.0), "parse_fail": v is None and not error, "error": error,
            "problem_type": rewards.canonical_type(s["problem_type"]), **{k: s[k] for k in ad.get("keys", ()) if k in s}}


def mean(xs) -> float:
    xs = list(xs)
    return 100 * sum(xs) / len(xs) if xs else float("nan")


def macro(rows: list[dict], keys: tuple) -> float:
    """Mean over values of keys[0] of (the macro over keys[1:] within it): MLVU M-Avg, VSI overall, OVO total."""
    groups = {}
    for r in rows:
        groups.setdefault(str(r.get(keys[0])), []).append(r)
    return sum(macro(g, keys[1:]) if keys[1:] else mean(x["score"] for x in g) for g in groups.values()) / len(groups)


def aggregate(rows: list[dict], bench: str) -> dict:
    """The official aggregate and breakdown of one benchmark, in percent."""
    ad, sc = ADAPTERS[bench], [r["score"] for r in rows]
    m = {"n": len(rows), "accuracy": mean(sc), "parse_fail": sum(r["parse_fail"] for r in rows),
         "failed": sum(bool(r["error"]) for r in rows)}
    if ad.get("macro") and rows:
        m["overall"] = macro(rows, ad["macro"])
    if ad.get("tiou"):  # grounding: recall at IoU thresholds and mean IoU (the score is the IoU)
        m.update({f"R@{t}": mean(x >= t for x in sc) for t in (0.3, 0.5, 0.7)}, mIoU=mean(sc))
    if ad.get("group") and all(ad["group"] in r for r in rows):  # Video-MME-v2 relevance: (k/n)^2 per group
        groups = {}
        for r in rows:
            groups.setdefault(r[ad["group"]], []).append(r["score"])
        m["group_score"] = mean((sum(g) / len(g)) ** 2 for g in groups.values())
    for k in ad.get("keys", ()):
        vals = sorted({v for r in rows for v in (r[k] if isinstance(r.get(k), list) else [r.get(k)]) if v is not None}, key=str)
        m.update({f"{k}/{v}": mean(r["score"] for r in rows if v == r.get(k) or isinstance(r.get(k), list) and v in r[k]) for v in vals})
    return m


def evaluate_prompts(generate, prompts: list, bench: str = "nvr1") -> tuple[list[dict], dict]:
    """For train.py: generate(prompts) -> texts with any engine; rows and the aggregate. Same scoring as a run."""
    rows = [record(p.sample, bench, p.text, t) for p, t in zip(prompts, generate(prompts))]
    return rows, aggregate(rows, bench)


# ---------------------------------------------------------------------------------------------------
# the pipeline
JUDGE = ("Judge whether the model answer is semantically consistent with the ground truth answer.\nReply with a brief "
         "reason, then output \"Judgement: 1\" if consistent or \"Judgement: 0\" if not.\nGround Truth: {answer}\n"
         "Model Answer: {pred}")


def make_loader(processor, cfg, bench: str):
    """load(sample) -> data.Prompt, safe to call from several threads (one processor copy per thread)."""
    local, all_stats = threading.local(), []

    def load(s):
        if not hasattr(local, "proc"):  # a fast tokenizer shared across threads can fail with "Already borrowed"
            local.proc, local.stats = copy.deepcopy(processor), {}
            all_stats.append(local.stats)
        return data.prepare(s, local.proc, cfg, local.stats, template=ADAPTERS[bench].get("prompt"))
    return load, all_stats


async def run_async(engine, samples: list, load, cfg: Config, bench: str, write, stats: dict):
    """AsyncLLM pipeline: loader threads -> engine -> scorer, at most max_in_flight samples alive at once."""
    from vllm import SamplingParams
    sp = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed, skip_special_tokens=True,
                        allowed_token_ids=stats.pop("allowed"))
    loop, sem, pool = asyncio.get_running_loop(), asyncio.Semaphore(cfg.max_in_flight), ThreadPoolExecutor(cfg.loader_threads)
    busy = dict(n=0, since=time.perf_counter(), busy=0.0, area=0.0)

    def track(d):  # time with >= 1 request in the engine, and the mean number in it
        now = time.perf_counter()
        busy["busy"] += (now - busy["since"]) * (busy["n"] > 0)
        busy["area"] += (now - busy["since"]) * busy["n"]
        busy["since"], busy["n"] = now, busy["n"] + d

    async def one(s):
        async with sem:
            try:
                p = await loop.run_in_executor(pool, load, s)
            except (DataError, cache.VideoError, OSError) as e:
                return write(record(s, bench, "", "", f"{type(e).__name__}: {e}"))
            track(+1)
            try:
                async for out in engine.generate(data.vllm_input(p), sp, request_id=f"{bench}:{s['id']}"):
                    pass
            finally:
                track(-1)
        write(record(s, bench, p.text, out.outputs[0].text))

    t = time.perf_counter()
    await asyncio.gather(*(one(s) for s in samples))
    pool.shutdown()
    track(0)
    wall = time.perf_counter() - t
    stats.update(engine_busy=busy["busy"] / max(wall, 1e-9), mean_in_flight=busy["area"] / max(wall, 1e-9))


def run_sync(generate, samples: list, load, cfg: Config, bench: str, write):
    """The plain loop: load a batch (decode or cache), generate, wait, repeat."""
    for i in range(0, len(samples), cfg.batch_size):
        ok = []
        for s in samples[i:i + cfg.batch_size]:
            try:
                ok.append(load(s))
            except (DataError, cache.VideoError, OSError) as e:
                write(record(s, bench, "", "", f"{type(e).__name__}: {e}"))
        for p, text in zip(ok, generate(ok) if ok else []):
            write(record(p.sample, bench, p.text, text))


def judge_rows(rows: list[dict], cfg: Config):
    """Rescore open-ended rows of judge benchmarks with the judge model (greedy; EasyVideoR1 uses T=0.1)."""
    todo = [r for r in rows if r.get("judge") == "none"]
    if not (todo and cfg.judge_model):
        return
    from vllm import LLM, SamplingParams
    llm = LLM(model=cfg.judge_model, dtype=cfg.dtype, max_model_len=cfg.max_model_len, seed=cfg.seed,
              trust_remote_code=cfg.trust_remote_code)
    msgs = [[{"role": "user", "content": JUDGE.format(answer=r["target"], pred=r["filtered_resps"][0] or r["resps"][0])}]
            for r in todo]
    for r, o in zip(todo, llm.chat(msgs, SamplingParams(temperature=0, max_tokens=256), use_tqdm=False)):
        v = re.findall(r"Judgement\s*:\s*([01])", o.outputs[0].text)
        r.update(score=float(v[-1]) if v else 0.0, parse_fail=not v, judge=cfg.judge_model)


def make_engine(cfg: Config, tokenizer):
    """(engine, generate or None, allowed token ids). async: AsyncLLM; sync: rollout.VLLMEngine; hf: rollout.HFEngine."""
    from rollout import HFEngine, VLLMEngine, device_normalize_ok, vision_token_ids
    if cfg.engine == "hf":
        import torch
        from transformers import AutoModelForImageTextToText
        model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32,
                                                            trust_remote_code=cfg.trust_remote_code).eval()
        eos = model.generation_config.eos_token_id
        engine = HFEngine(model, tokenizer, eos if isinstance(eos, list) else [eos])
    elif cfg.engine == "sync":
        engine = VLLMEngine(cfg.model, tokenizer, max_model_len=cfg.max_model_len, dtype=cfg.dtype, seed=cfg.seed,
                            sleep=False, max_images=1, trust_remote_code=cfg.trust_remote_code)
    elif cfg.engine == "async":
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=cfg.model, dtype=cfg.dtype, max_model_len=cfg.max_model_len, seed=cfg.seed, enable_chunked_prefill=True,
            enforce_eager=not current_platform.is_cuda(), limit_mm_per_prompt={"image": 1, "video": 1},
            trust_remote_code=cfg.trust_remote_code,
            mm_device_do_normalize=device_normalize_ok(cfg.model, cfg.trust_remote_code)))
        banned = set(vision_token_ids(tokenizer))  # as rollout.VLLMEngine: identical greedy results
        return engine, None, [i for i in range(engine.model_config.get_vocab_size()) if i not in banned]
    else:
        raise ValueError(f"engine: unknown {cfg.engine!r} (async | sync | hf)")
    return engine, lambda ps: [r.text for r in engine.generate(ps, 1, cfg.temperature, cfg.max_tokens)], None


def read_log(path: str) -> tuple[dict, int]:
    """Finished rows of an earlier run by doc_id, and the number of torn lines (a crash mid-write) dropped."""
    done, torn = {}, 0
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                    done[r["doc_id"]] = r
                except (json.JSONDecodeError, KeyError, TypeError):
                    torn += 1
    return done, torn


def write_jsonl(path: str, rows: list[dict]):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)


async def evaluate(cfg: Config, engine=None, generate=None, allowed=None, processor=None) -> dict:
    """Every benchmark of cfg: resume, run, judge, aggregate; writes results.json, results.md. Returns results."""
    if processor is None:
        from transformers import AutoProcessor
        processor = AutoProcessor.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    own = engine is None
    if own:
        engine, generate, allowed = make_engine(cfg, processor.tokenizer)
    try:
        return await evaluate_all(cfg, engine, generate, allowed, processor)
    finally:
        if own and hasattr(engine, "shutdown"):
            engine.shutdown()  # AsyncLLM's engine-core process


async def evaluate_all(cfg: Config, engine, generate, allowed, processor) -> dict:
    results = {}
    for bench in cfg.benchmarks.split(","):
        skipped = []
        samples = load_benchmark(bench, cfg, skipped)
        if len({s["id"] for s in samples}) < len(samples):
            raise DataError(f"{bench}: duplicate sample ids: the resume log could not tell them apart")
        path = os.path.join(cfg.out_dir, bench, "samples.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        done, torn = read_log(path)
        write_jsonl(path, list(done.values()))  # drop torn lines before appending
        todo, stats, t = [s for s in samples if s["id"] not in done], {"allowed": allowed}, time.perf_counter()
        load, load_stats = make_loader(processor, cfg, bench)
        with open(path, "a", encoding="utf-8") as fh:
            def write(r):
                r = {**r, "judge": "none"} if ADAPTERS[bench].get("judge") and r["problem_type"] == "open-ended" else r
                fh.write(json.dumps(r) + "\n")
                fh.flush()
                done[r["doc_id"]] = r
            if generate is None:
                await run_async(engine, todo, load, cfg, bench, write, stats)
            else:
                run_sync(generate, todo, load, cfg, bench, write)
        rows = [done[s["id"]] for s in samples]  # sample order, one row per doc_id
        judge_rows(rows, cfg)
        write_jsonl(path, rows)
        stats.pop("allowed", None)
        n_judge = sum(r.get("judge") not in (None, "none") for r in rows)
        results[bench] = {"metrics": aggregate(rows, bench), "skipped": len(skipped), "resumed": len(samples) - len(todo),
                          "torn_lines": torn, "seconds": round(time.perf_counter() - t, 3), "samples": path,
                          "frames": {k: sum(s.get(k, 0) for s in load_stats) for k in ("cache_hit", "decode")}, **stats,
                          "judge": (cfg.judge_model if n_judge else "none: open-ended items scored by rule (ROUGE/exact), "
                                    "not the official LLM judge") if any("judge" in r for r in rows) else "not needed"}
        print(f"{bench}: " + " | ".join(f"{k} {v:.1f}" for k, v in results[bench]["metrics"].items() if "/" not in k), flush=True)
    write_results(results, cfg)
    return results


def write_results(results: dict, cfg: Config):
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
        json.dump({"settings": asdict(cfg), "benchmarks": results}, f, indent=1)
    lines = [f"model `{cfg.model}`, engine {cfg.engine}, temperature {cfg.temperature}, max_tokens {cfg.max_tokens}, "
             f"fps {cfg.video_fps}, frames {cfg.video_min_frames}-{cfg.video_max_frames}, max_pixels {cfg.video_max_pixels}",
             "", "| benchmark | metric | value | n |", "|---|---|---|---|"]
    for b, r in results.items():
        lines += [f"| {b} | {k} | {v:.2f} | {r['metrics']['n']} |" for k, v in r["metrics"].items() if k != "n"]
        lines += [f"| {b} | judge | {r['judge']} | |"] if r["judge"] != "not needed" else []
    with open(os.path.join(cfg.out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    import tyro
    asyncio.run(evaluate(tyro.cli(Config)))

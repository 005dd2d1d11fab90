"""rewards.py: one accuracy function per problem type, `(completion, sample) -> float in [0, 1]`,
in one dict. Adding a task is one function and one entry in ACCURACY.

    overall, components = compute_reward(completion, sample)     # overall = w_acc * acc + w_fmt * fmt

Problem types (ALIASES maps public datasets' names onto these):
    multiple choice      letter, or the text of one of sample["options"]
    numerical            numbers, fractions, percentages, number words ("twenty one"); tolerance NUM_RTOL
    counting             the same numbers, but exact
    regression           mean relative accuracy (MRA): share of t in 0.50, 0.55, ..., 0.95 with |pred - gt| / |gt| < 1 - t
    boolean              yes/no/true/false
    open-ended           mean of ROUGE-1/2/L F1; exact match (case/punctuation-insensitive) for short answers
    ocr                  1 - word error rate, clipped to [0, 1]
    math                 math-verify equivalence, under a wall-clock limit of MATH_TIMEOUT s (see acc_math)
    temporal grounding   1-D IoU of {"time": [start, end]}, start <= end
    spatial grounding    box IoU of {"boxes": [x1, y1, x2, y2]}, x1 <= x2 and y1 <= y2
    spatial-temporal grounding   0.5 * time IoU + 0.5 * mean box IoU over the seconds both have (as EasyVideoR1)
    tracking             mean box IoU over the frames both have (0 if none)
    code                 1 if the answer parses: as Python (ast.parse), or as XML when it starts with "<"
                         (svg-code); never executed

Answer extraction (extract_answer), in order: <think>...</think> blocks are removed; the LAST
<answer>...</answer> (innermost when nested; an empty one is None); else the last \\boxed{...}; else a
"the answer is X" phrase; else the text after </think>; else None (a parse failure: scored 0 and counted
in components["parse_fail"]). Only the last MAX_LEN characters are read (the answer comes last). Extraction and
JSON parsing use str.find, not backtracking regexes: linear time.
Rewards never raise on model output and always return a value in [0, 1].
"""
import ast
import ctypes
import gc
import json
import math
import re
import signal
import threading
import warnings
import xml.etree.ElementTree as ET
from functools import lru_cache

import numpy as np

THRESHOLDS = [round(0.5 + 0.05 * i, 2) for i in range(10)]  # MRA thresholds 0.50..0.95
MARGINS = [round(1 - t, 2) for t in THRESHOLDS]  # 1 - t as exact decimals: 1 - 0.7 is 0.30000000000000004 in floats
VSI_MARGINS = (1 - np.linspace(0.5, 0.95, 10)).tolist()  # the official code's float margins (0.30000000000000004)
NUM_RTOL = 1e-2  # numerical: |pred - gt| <= NUM_RTOL * max(1, |gt|)
MAX_LEN = 20000  # completions are cut to their last MAX_LEN characters before any regex runs (bounded time)
MATH_TIMEOUT = 1.0  # seconds of math-verify per call (SIGALRM in the main thread, else a watchdog thread)

ALIASES = {
    "multiple_choice": "multiple choice", "mcq": "multiple choice", "mc": "multiple choice",
    "multiple-choice": "multiple choice", "multi-choice": "multiple choice",  # Video-MMMU/MMVU, TempCompass
    "number": "numerical", "numeric": "numerical", "count": "counting", "rec": "counting",  # OVO-Bench REC
    "binary classification": "boolean", "yes/no": "boolean", "yes_no": "boolean", "ssr": "boolean", "crr": "boolean",
    "open_ended": "open-ended", "free-form": "open-ended", "free_form": "open-ended", "video qa": "open-ended",
    "video description": "open-ended", "caption": "open-ended", "captioning": "open-ended", "mathematics": "math",
    "coding": "code", "svg-code": "code",  # html-code is left out: HTML is not XML, and we have no HTML parser
    "temporal_grounding": "temporal grounding", "spatial_grounding": "spatial grounding",
    "spatial_temporal_grounding": "spatial-temporal grounding",
}

# ---------------------------------------------------------------------------------------------------
# extraction: str.find and linear-time patterns only (no nested quantifiers), on length-capped input
_PHRASE = re.compile(r"answer is[:\s]*([^\n]{1,1000})", re.I)
_NUM = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")
WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                    "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
WORDS |= {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}


def strip_think(text: str) -> str:
    """Remove every closed <think>...</think> block (leftmost first, like a lazy regex, but linear)."""
    out, i = [], 0
    while (j := text.find("<think>", i)) >= 0 and (k := text.find("</think>", j)) >= 0:
        out.append(text[i:j])
        i = k + len("</think>")
    return "".join(out) + text[i:]


def last_answer(text: str) -> str | None:
    """Content of the last closed <answer>...</answer>; for nested tags, the innermost one."""
    k = text.rfind("</answer>")
    j = text.rfind("<answer>", 0, k) if k >= 0 else -1
    return None if j < 0 else text[j + 8:text.find("</answer>", j)]


def answer_text(text: str) -> str:
    """The answer taken out of our output format, before any type-specific reading (training rewards and
    evaluate.py's official readers both start here): the content of the last closed <answer> tag when there is
    one, else the response without its closed <think> blocks; '' when a <think> is left open (nothing was
    committed after it)."""
    text = (text or "")[-MAX_LEN:]
    body = strip_think(text)
    ans = last_answer(body)
    if ans is not None:
        return ans.strip()
    if "<think>" in body:  # an unfinished <think>: its text is reasoning, not an answer
        return ""
    return body.strip()


def extract_answer(text: str) -> str | None:
    text = (text or "")[-MAX_LEN:]
    k = text.rfind("</think>")
    after_think = text[k + 8:] if k >= 0 else ""
    text = strip_think(text)
    ans = last_answer(text)
    if ans is not None:
        return ans.strip() or None
    if (i := text.rfind("\\boxed{")) >= 0:  # the last \boxed{...}, braces balanced, \text{} unwrapped
        depth = 1
        for j in range(i + 7, min(len(text), i + 1007)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                if box := re.sub(r"^\\text\{(.*)\}$", r"\1", text[i + 7:j].strip(), flags=re.S).strip():
                    return box
                break
    if (hits := _PHRASE.findall(text)) and (ans := hits[-1].strip().rstrip(".").strip()):
        return ans
    return after_think.strip() or None


def ground_truth(sample: dict) -> str:
    gt = str(sample.get("answer", ""))
    ans = last_answer(gt)
    return (gt if ans is None else ans).strip()


def canonical_type(problem_type: str) -> str:
    t = " ".join(str(problem_type).strip().lower().split())
    return ALIASES.get(t, t)


# ---------------------------------------------------------------------------------------------------
# parsers (None on failure, never raise)
def parse_number(s: str) -> float | None:
    """First number in s: "3", "-1,000.5", "1e3", "1/2", "50%" (= 0.5), "twenty-one"; None if none (or x/0)."""
    s = s.strip().lower()
    m = _NUM.search(s)
    if not m:
        ws = re.findall(r"[a-z]+", s) + [""]
        i = next((i for i, x in enumerate(ws) if x in WORDS), None)
        if i is None:
            return None
        v, unit = WORDS[ws[i]], WORDS.get(ws[i + 1], 0)
        return float(v + unit if v >= 20 and unit < 10 else v)  # "twenty one"; "twenty twelve" is 20
    try:
        v = float(m.group(0).replace(",", ""))
    except ValueError:
        return None
    rest = s[m.end():m.end() + 40]
    if frac := re.match(r"\s*/\s*(\d+(?:\.\d+)?)", rest):
        d = float(frac.group(1))
        v = v / d if d else math.nan
    elif rest.lstrip().startswith("%"):
        v = v / 100
    return v if math.isfinite(v) else None


def parse_json(s: str):
    """json.loads(s), else of the outermost {...} or [...] inside prose; None if neither parses."""
    cands = [s] + [s[s.find(a):s.rfind(b) + 1] for a, b in ("{}", "[]") if s.find(a) >= 0]
    for c in cands:
        try:
            return json.loads(c)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; deep nesting recurses
            pass
    return None


def finite(v) -> bool:  # a JSON number (not a bool), finite as a float: NaN, inf and 10**400 are rejected
    return type(v) is float and math.isfinite(v) or type(v) is int and abs(v) < 1e300


def as_span(x) -> list[float] | None:  # [start, end] with start <= end, else None (for answers and ground truth)
    t = x.get("time") if isinstance(x, dict) else x
    ok = isinstance(t, (list, tuple)) and len(t) == 2 and all(finite(v) for v in t) and t[0] <= t[1]
    return [float(t[0]), float(t[1])] if ok else None


def as_box(b) -> list[float] | None:  # [x1, y1, x2, y2] with x1 <= x2, y1 <= y2 (an [x, y, w, h] usually fails)
    b = b[0] if isinstance(b, list) and len(b) == 1 else b  # [[x1, y1, x2, y2]]: a list of one box
    ok = isinstance(b, (list, tuple)) and len(b) == 4 and all(finite(v) for v in b) and b[0] <= b[2] and b[1] <= b[3]
    return [float(v) for v in b] if ok else None


def frame_key(k) -> str:  # frame/second keys compare as numbers: "1", "1.0" and 1 are the same frame
    try:
        return repr(float(k))
    except (ValueError, OverflowError):
        return str(k)


def as_boxes(x) -> dict | None:
    b = x.get("boxes") if isinstance(x, dict) else None
    if not isinstance(b, dict):
        return None
    out = {frame_key(k): as_box(v) for k, v in b.items()}
    return None if not out or any(v is None for v in out.values()) else out


# ---------------------------------------------------------------------------------------------------
# scorers: shared with evaluate.py
def iou_1d(a, b) -> float:
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(a[1], b[1]) - min(a[0], b[0])
    return inter / union if union > 0 else float(a == b)


def iou_box(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    area = lambda x: max(0.0, x[2] - x[0]) * max(0.0, x[3] - x[1])  # noqa: E731
    union = area(a) + area(b) - ix * iy
    return ix * iy / union if union > 0 else float(a == b)  # two equal empty boxes match, as in iou_1d


def mra(pred: float, gt: float, inclusive: bool = False) -> float:
    """Mean relative accuracy: share of thresholds t with |pred - gt| / |gt| < 1 - t (EasyVideoR1's training
    reward); inclusive=True uses <=, as the official VSI-Bench code (evaluate.py)."""
    rel = abs(pred - gt) / max(abs(gt), 1e-9)
    margins = VSI_MARGINS if inclusive else MARGINS
    return sum(rel <= m if inclusive else rel < m for m in margins) / len(margins)


def _tokens(s: str) -> list[str]:
    return re.findall(r"\w+", s.lower())


def _f1(overlap: int, n_pred: int, n_ref: int) -> float:
    return 0.0 if overlap == 0 else 2 * overlap / (n_pred + n_ref)


def rouge(pred: str, ref: str) -> float:
    """Mean of ROUGE-1, ROUGE-2 and ROUGE-L F1 on lower-cased word tokens."""
    from collections import Counter
    p, r = _tokens(pred)[:2000], _tokens(ref)[:2000]
    if not p or not r:
        return 0.0
    scores = []
    for n in (1, 2):
        pg, rg = Counter(zip(*[p[i:] for i in range(n)])), Counter(zip(*[r[i:] for i in range(n)]))
        scores.append(_f1(sum((pg & rg).values()), sum(pg.values()), sum(rg.values())))
    prev = [0] * (len(r) + 1)  # LCS by dynamic programming, O(len(p) * len(r))
    for x in p:
        cur = [0]
        for j, y in enumerate(r):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    scores.append(_f1(prev[-1], len(p), len(r)))
    return sum(scores) / 3


def wer(pred: str, ref: str) -> float:
    p, r = pred.lower().split()[:2000], ref.lower().split()[:2000]
    if not r:
        return float(bool(p))
    prev = list(range(len(r) + 1))
    for i, x in enumerate(p, 1):
        cur = [i]
        for j, y in enumerate(r, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1] / len(r)


def norm_text(s: str) -> str:
    return " ".join(_tokens(s))


# ---------------------------------------------------------------------------------------------------
# accuracy rewards: (answer extracted from the completion, sample) -> float, or None when unparseable
def option_table(options: list[str]) -> list[tuple[str, str]]:
    """[(letter, text)] from "A. red" / "A) red" / "(A) red"; an option without a letter gets its position's."""
    ms = [(re.match(r"\s*\(?([A-Za-z])[.):]\s*(.*)", o, re.S), o) for o in options or []]
    return [(m.group(1).upper(), m.group(2)) if m else (chr(65 + i % 26), o) for i, (m, o) in enumerate(ms)]


def choice_letter(ans: str, options: list[str]) -> str | None:
    """The option letter an answer names: "B", "(b)", "B. dog", or exactly the text of option B."""
    table = option_table(options)
    m = re.match(r"\s*\(?([A-Za-z])\)?(?:[.):\s]|$)", ans)
    ok = m is not None and (not table or m.group(1).upper() in {lt for lt, _ in table})
    if ok and re.fullmatch(r"\s*\(?[A-Za-z]\)?[.):]?\s*", ans):  # a bare letter
        return m.group(1).upper()
    for lt, body in table:  # the option's text ("A dog ..." must not read as letter A)
        if norm_text(body) and norm_text(ans) == norm_text(body):
            return lt
    return m.group(1).upper() if ok else None


def acc_choice(ans, s):
    got = choice_letter(ans, s.get("options") or [])
    return None if got is None else float(got == choice_letter(ground_truth(s), s.get("options") or []))


def acc_number(ans, s, rtol: float = NUM_RTOL):
    p, g = parse_number(ans), parse_number(ground_truth(s))
    return None if p is None else float(abs(p - g) <= rtol * max(1.0, abs(g)) * (1 + 1e-9))  # 1.01 vs 1: on the edge


def acc_regression(ans, s):
    p = parse_number(ans)
    return None if p is None else mra(p, parse_number(ground_truth(s)))


def acc_boolean(ans, s):
    norm = lambda x: {"yes": 1, "true": 1, "no": 0, "false": 0}.get(norm_text(x).split(" ")[0] if norm_text(x) else "")  # noqa: E731
    p = norm(ans)
    return None if p is None else float(p == norm(ground_truth(s)))


def acc_open(ans, s):
    gt = ground_truth(s)
    if len(_tokens(gt)) <= 3:  # short answers: exact match; ROUGE would reward partial words
        return float(norm_text(ans) == norm_text(gt))
    return rouge(ans, gt)


def acc_ocr(ans, s):
    gt = ground_truth(s)
    if len(ans.split()) >= 2 * len(gt.split()):  # WER >= (n_pred - n_ref) / n_ref >= 1: skip the O(n * m) table
        return 0.0
    return max(0.0, 1.0 - wer(ans, gt))


class MathTimeout(BaseException):  # a BaseException: math-verify's own `except Exception` can't swallow it
    pass


_ASYNC_RAISE, _ARM_LOCK, _MAIN_ARMED = ctypes.pythonapi.PyThreadState_SetAsyncExc, threading.Lock(), [False]


def _alarm(signum, frame):
    if _MAIN_ARMED[0]:  # a late alarm, after the work is done, is a no-op
        raise MathTimeout


def _watchdog(tid: int, armed: list, done: threading.Event):
    """Outside the main thread: after MATH_TIMEOUT s raise MathTimeout in thread `tid`, then every 50 ms while armed."""
    wait = MATH_TIMEOUT
    while not done.wait(wait) and armed[0]:
        with _ARM_LOCK:  # injects only while armed: acc_math disarms, then clears under the same lock
            if armed[0]:
                _ASYNC_RAISE(ctypes.c_ulong(tid), ctypes.py_object(MathTimeout))
        wait = 0.05


@lru_cache(maxsize=1)
def _math_warm() -> bool:  # sympy's first symbolic compare imports lazily for ~0.3 s: not on the clock
    from math_verify import parse, verify
    return verify(parse("$2x$"), parse("$x + x$"))


@lru_cache(maxsize=4096)
def _math_gold(gt: str):
    from math_verify import parse
    return parse(f"${gt}$", parsing_timeout=None)


def acc_math(ans, s):
    """math-verify's own timeouts are whole-second signal.alarm()s that fail outside the main thread, so we turn them
    off and bound parse + verify ourselves. In the main thread: a SIGALRM timer, which also stops a long big-int C
    loop (CPython polls for signals there). Elsewhere: a watchdog thread raising MathTimeout into this one, which acts
    between bytecodes only, so there one huge C-level step (2^{2^{2^{99}}}) is NOT stopped: score in the main thread.
    Both repeat every 50 ms until disarmed, in case a bare `except:` swallows one; and the garbage collector is off
    meanwhile, since an exception raised inside a gc callback is swallowed too (and reported as unraisable)."""
    from math_verify import parse, verify
    _math_warm()
    main, tid, done = threading.current_thread() is threading.main_thread(), threading.get_ident(), threading.Event()
    armed, gc_on = _MAIN_ARMED if main else [True], gc.isenabled()
    gc.disable()
    if main:
        old = signal.signal(signal.SIGALRM, _alarm)
        _MAIN_ARMED[0] = True
        signal.setitimer(signal.ITIMER_REAL, MATH_TIMEOUT, 0.05)
    else:
        threading.Thread(target=_watchdog, args=(tid, armed, done), daemon=True).start()
    try:
        try:
            gold, pred = _math_gold(ground_truth(s)), parse(f"${ans[:2000]}$", parsing_timeout=None)
            return float(bool(pred) and verify(gold, pred, timeout_seconds=None))
        finally:
            armed[0] = False  # first: a plain store, where no signal handler runs and no async exception lands
            if main:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, signal.SIG_DFL if old is None else old)
            else:
                with _ARM_LOCK:
                    _ASYNC_RAISE(ctypes.c_ulong(tid), None)  # drop one injected but not yet delivered
                done.set()
            if gc_on:
                gc.enable()
    except (Exception, MathTimeout):  # noqa: BLE001  math-verify raises a zoo of sympy errors: all mean "not equal"
        return 0.0


def acc_temporal(ans, s):
    p = as_span(parse_json(ans))
    return None if p is None else iou_1d(p, as_span(parse_json(ground_truth(s))))


def acc_spatial(ans, s):
    x = parse_json(ans)
    p = as_box(x.get("boxes") if isinstance(x, dict) else x)  # {"boxes": box} or a bare [x1, y1, x2, y2]
    return None if p is None else iou_box(p, as_box(parse_json(ground_truth(s))["boxes"]))


def mean_box_iou(pred: dict, gt: dict) -> float:
    """Mean IoU over the frames both have (EasyVideoR1, STVG): frames outside the predicted span are not penalised
    here, the time IoU is; no common frame scores 0."""
    common = pred.keys() & gt.keys()
    return sum(iou_box(pred[k], gt[k]) for k in common) / len(common) if common else 0.0


def acc_st(ans, s):
    x, g = parse_json(ans), parse_json(ground_truth(s))
    span, boxes = as_span(x), as_boxes(x)
    if span is None or boxes is None:
        return None
    return 0.5 * iou_1d(span, as_span(g)) + 0.5 * mean_box_iou(boxes, as_boxes(g))


def acc_tracking(ans, s):
    boxes = as_boxes(parse_json(ans))
    return None if boxes is None else mean_box_iou(boxes, as_boxes(parse_json(ground_truth(s))))


def acc_code(ans, s):
    code = re.sub(r"^```\w*\n?|```$", "", ans.strip()).strip()
    try:
        with warnings.catch_warnings():  # e.g. SyntaxWarning for "\d" in a string literal: not our log's business
            warnings.simplefilter("ignore")
            # syntax only, never executed; expat expands no external entities and refuses entity bombs
            ET.fromstring(code) if code.startswith("<") else ast.parse(code)
        return 1.0
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ET.ParseError is a SyntaxError
        return 0.0


ACCURACY = {
    "multiple choice": acc_choice, "numerical": acc_number, "counting": lambda a, s: acc_number(a, s, rtol=0.0),
    "regression": acc_regression,
    "boolean": acc_boolean, "open-ended": acc_open, "ocr": acc_ocr, "math": acc_math,
    "temporal grounding": acc_temporal, "spatial grounding": acc_spatial,
    "spatial-temporal grounding": acc_st, "tracking": acc_tracking, "code": acc_code,
}

FORMATS = {
    "answer": re.compile(r"\s*<answer>(?:(?!</?answer>).){0,5000}</answer>\s*", re.S),
    "think_answer": re.compile(r"\s*<think>(?:(?!</?think>).){0,20000}</think>\s*<answer>(?:(?!</?answer>).){0,5000}</answer>\s*", re.S),
}


def format_reward(completion: str, template: str = "answer") -> float:
    """1 if the whole completion is exactly the template (one answer block, optional surrounding space)."""
    c = (completion or "")[:MAX_LEN]
    return float(FORMATS[template].fullmatch(c) is not None and c.count("<answer>") == 1)


def compute_reward(completion: str, sample: dict, w_acc: float = 0.9, w_fmt: float = 0.1,
                   format_template: str = "answer") -> tuple[float, dict]:
    """(overall, {"overall", "accuracy", "format", "parse_fail"}). Unknown types are scored open-ended."""
    fn = ACCURACY.get(canonical_type(sample.get("problem_type", "")), acc_open)
    ans = extract_answer(completion)
    acc = None
    if ans is not None:
        try:
            acc = fn(ans, sample)
        except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, RecursionError, OverflowError):
            acc = None  # a malformed *prediction* the parser let through: counted as a parse failure
    fmt = format_reward(completion, format_template)
    acc_v = min(1.0, max(0.0, float(acc))) if acc is not None and math.isfinite(acc) else 0.0
    overall = w_acc * acc_v + w_fmt * fmt
    return overall, {"overall": overall, "accuracy": acc_v, "format": fmt, "parse_fail": float(acc is None)}


def validate_answer(sample: dict) -> None:
    """Raise ValueError (naming the sample) when the ground truth does not fit its problem type."""
    t, gt, sid = canonical_type(sample.get("problem_type", "")), ground_truth(sample), sample.get("id", "?")
    bad = None
    if not gt and t != "code":
        bad = "answer is empty"
    elif t == "multiple choice":
        opts = sample.get("options") or []
        if choice_letter(gt, opts) is None:
            bad = f"answer {gt!r} is not one of the option letters {[lt for lt, _ in option_table(opts)] or 'A-Z'}"
    elif t in ("numerical", "counting", "regression") and parse_number(gt) is None:
        bad = f"answer {gt!r} is not a number"
    elif t == "boolean" and acc_boolean(gt, {"answer": "yes"}) is None:
        bad = f"answer {gt!r} is not yes/no/true/false"
    elif t == "temporal grounding" and as_span(parse_json(gt)) is None:
        bad = f'answer {gt[:80]!r} is not {{"time": [start, end]}} with start <= end'
    elif t == "spatial grounding" and not (isinstance(x := parse_json(gt), dict) and as_box(x.get("boxes"))):
        bad = f'answer {gt[:80]!r} is not {{"boxes": [x1, y1, x2, y2]}} with x1 <= x2, y1 <= y2'
    elif t == "spatial-temporal grounding" and (as_span(x := parse_json(gt)) is None or as_boxes(x) is None):
        bad = f'answer {gt[:80]!r} is not {{"time": [s, e], "boxes": {{"<sec>": [x1, y1, x2, y2]}}}} with s <= e'
    elif t == "tracking" and as_boxes(parse_json(gt)) is None:
        bad = f'answer {gt[:80]!r} is not {{"boxes": {{"<frame>": [x1, y1, x2, y2]}}}} with x1 <= x2, y1 <= y2'
    elif t not in ACCURACY:
        bad = f"unknown problem_type {sample.get('problem_type')!r} (known: {sorted(ACCURACY)} and aliases)"
    if bad:
        raise ValueError(f"sample {sid}: {bad}")

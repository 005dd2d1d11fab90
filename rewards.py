"""rewards.py: one accuracy function per problem type, `(completion, sample) -> float in [0, 1]`,
in one dict. Adding a task is one function and one entry in ACCURACY.

    overall, components = compute_reward(completion, sample)     # overall = w_acc * acc + w_fmt * fmt

Problem types (ALIASES maps public datasets' names onto these):
    multiple choice      letter, or the text of one of sample["options"]
    numerical, counting  numbers, fractions, percentages, number words; relative tolerance NUM_RTOL
    regression           mean relative accuracy (MRA) over thresholds 0.50, 0.55, ..., 0.95
    boolean              yes/no/true/false
    open-ended           mean of ROUGE-1/2/L F1; exact match (case/punctuation-insensitive) for short answers
    ocr                  1 - word error rate, clipped to [0, 1]
    math                 math-verify equivalence, under a time limit
    temporal grounding   1-D IoU of {"time": [start, end]}
    spatial grounding    box IoU of {"boxes": [x1, y1, x2, y2]}
    spatial-temporal grounding   time IoU x mean box IoU over the seconds both have
    tracking             mean box IoU over the frames both have (missing frames count 0)
    code                 1 if the answer parses as Python (ast.parse; never executed)

Answer extraction (extract_answer), in order: <think>...</think> blocks are removed; the LAST
<answer>...</answer>; else the last \\boxed{...}; else a "the answer is X" phrase; else the text after
</think>; else None (a parse failure: scored 0 and counted in components["parse_fail"]).
Rewards never raise on model output and always return a value in [0, 1].
"""
import ast
import json
import math
import re

THRESHOLDS = [0.5 + 0.05 * i for i in range(10)]  # MRA thresholds 0.50..0.95
NUM_RTOL = 1e-2  # numerical: |pred - gt| <= NUM_RTOL * max(1, |gt|)
MAX_LEN = 20000  # completions are cut to this many characters before any regex runs (bounded time)

ALIASES = {
    "multiple_choice": "multiple choice", "mcq": "multiple choice", "mc": "multiple choice",
    "number": "numerical", "numeric": "numerical", "count": "counting",
    "binary classification": "boolean", "yes/no": "boolean", "yes_no": "boolean",
    "open_ended": "open-ended", "free-form": "open-ended", "free_form": "open-ended", "video qa": "open-ended",
    "video description": "open-ended", "caption": "open-ended", "mathematics": "math",
    "coding": "code", "svg-code": "code", "html-code": "code",
    "temporal_grounding": "temporal grounding", "spatial_grounding": "spatial grounding",
    "spatial-temporal grounding": "spatial-temporal grounding", "spatial_temporal_grounding": "spatial-temporal grounding",
}

# ---------------------------------------------------------------------------------------------------
# extraction: linear-time patterns only (no nested quantifiers), on length-capped input
_THINK = re.compile(r"<think>.*?</think>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_PHRASE = re.compile(r"answer is[:\s]*([^\n]{1,200})", re.I)
_NUM = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")
WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                    "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}


def extract_answer(text: str) -> str | None:
    text = (text or "")[:MAX_LEN]
    after_think = text.rsplit("</think>", 1)[1] if "</think>" in text else None
    text = _THINK.sub("", text)
    hits = _ANSWER.findall(text)
    if hits:
        return hits[-1].strip()
    i = text.rfind("\\boxed{")
    if i >= 0:
        depth, j = 1, i + 7
        for j in range(i + 7, min(len(text), i + 7 + 1000)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 7:j].strip()
    m = None
    for m in _PHRASE.finditer(text):
        pass
    if m:
        return m.group(1).strip().rstrip(".").strip()
    if after_think is not None and after_think.strip():
        return after_think.strip()
    return None


def ground_truth(sample: dict) -> str:
    gt = str(sample.get("answer", ""))
    hits = _ANSWER.findall(gt)
    return (hits[-1] if hits else gt).strip()


def canonical_type(problem_type: str) -> str:
    t = " ".join(str(problem_type).strip().lower().split())
    return ALIASES.get(t, t)


# ---------------------------------------------------------------------------------------------------
# parsers (None on failure, never raise)
def parse_number(s: str) -> float | None:
    s = s.strip().lower().rstrip(".")
    if s in WORDS:
        return float(WORDS[s])
    frac = re.fullmatch(r"\s*([-+]?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)\s*", s)
    if frac and float(frac.group(2)) != 0:
        return float(frac.group(1)) / float(frac.group(2))
    m = _NUM.search(s)
    if not m:
        w = next((WORDS[x] for x in re.findall(r"[a-z]+", s) if x in WORDS), None)
        return None if w is None else float(w)
    try:
        v = float(m.group(0).replace(",", ""))
    except ValueError:
        return None
    v = v / 100 if s[m.end():m.end() + 1] == "%" else v
    return v if math.isfinite(v) else None


def parse_json(s: str):
    try:
        return json.loads(s)
    except (json.JSONDecodeError, RecursionError, ValueError):
        m = re.search(r"\{.*\}", s, re.S)  # tolerate prose around the object
        if m and m.group(0) != s:
            return parse_json(m.group(0))
        return None


def as_span(x) -> list[float] | None:
    t = x.get("time") if isinstance(x, dict) else x
    if isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in t):
        return [float(t[0]), float(t[1])]
    return None


def as_box(b) -> list[float] | None:
    if isinstance(b, (list, tuple)) and len(b) == 4 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in b):
        return [float(v) for v in b]
    return None


def as_boxes(x) -> dict | None:
    b = x.get("boxes") if isinstance(x, dict) else None
    if not isinstance(b, dict):
        return None
    out = {str(k): as_box(v) for k, v in b.items()}
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
    return ix * iy / union if union > 0 else 0.0


def mra(pred: float, gt: float) -> float:
    """Mean relative accuracy (VSI-Bench): share of thresholds t with |pred - gt| / |gt| < 1 - t."""
    rel = abs(pred - gt) / max(abs(gt), 1e-9)
    return sum(rel < 1 - t for t in THRESHOLDS) / len(THRESHOLDS)


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
def choice_letter(ans: str, options: list[str]) -> str | None:
    m = re.match(r"\s*\(?([A-Za-z])\)?(?:[.):\s]|$)", ans)
    if m and (not options or m.group(1).upper() in letters(options)):
        return m.group(1).upper()
    for opt in options or []:  # the model answered with the option's text
        lt, _, body = opt.partition(".")
        if body.strip() and norm_text(ans) == norm_text(body):
            return lt.strip().upper()
    return None


def letters(options: list[str]) -> list[str]:
    return [o.split(".", 1)[0].strip().upper() for o in options]


def acc_choice(ans, s):
    got = choice_letter(ans, s.get("options") or [])
    return None if got is None else float(got == choice_letter(ground_truth(s), s.get("options") or []))


def acc_number(ans, s):
    p, g = parse_number(ans), parse_number(ground_truth(s))
    return None if p is None else float(abs(p - g) <= NUM_RTOL * max(1.0, abs(g)))


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
    return max(0.0, 1.0 - wer(ans, ground_truth(s)))


def acc_math(ans, s):
    from math_verify import parse, verify
    try:  # math-verify's own timeouts are signal-based: only in the main thread
        import threading
        t = 3 if threading.current_thread() is threading.main_thread() else None
        gold, pred = parse(f"${ground_truth(s)}$", parsing_timeout=t), parse(f"${ans}$", parsing_timeout=t)
        return float(bool(pred) and verify(gold, pred, timeout_seconds=t))
    except Exception:  # noqa: BLE001  math-verify raises a zoo of sympy errors and TimeoutError: all mean "not equal"
        return 0.0


def acc_temporal(ans, s):
    p = as_span(parse_json(ans))
    return None if p is None or p[0] > p[1] else iou_1d(p, as_span(parse_json(ground_truth(s))))


def acc_spatial(ans, s):
    x = parse_json(ans)
    p = as_box(x.get("boxes") if isinstance(x, dict) else x)
    return None if p is None else iou_box(p, as_box(parse_json(ground_truth(s))["boxes"]))


def mean_box_iou(pred: dict, gt: dict) -> float:
    """Mean IoU over the ground truth's frames; a frame the prediction lacks scores 0."""
    return sum(iou_box(pred[k], b) if k in pred else 0.0 for k, b in gt.items()) / len(gt)


def acc_st(ans, s):
    x, g = parse_json(ans), parse_json(ground_truth(s))
    span, boxes = as_span(x), as_boxes(x)
    if span is None or boxes is None:
        return None
    return iou_1d(span, as_span(g)) * mean_box_iou(boxes, as_boxes(g))


def acc_tracking(ans, s):
    boxes = as_boxes(parse_json(ans))
    return None if boxes is None else mean_box_iou(boxes, as_boxes(parse_json(ground_truth(s))))


def acc_code(ans, s):
    code = re.sub(r"^```\w*\n?|```$", "", ans.strip())
    try:
        ast.parse(code)  # syntax only: model output is never executed
        return 1.0
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0.0


ACCURACY = {
    "multiple choice": acc_choice, "numerical": acc_number, "counting": acc_number, "regression": acc_regression,
    "boolean": acc_boolean, "open-ended": acc_open, "ocr": acc_ocr, "math": acc_math,
    "temporal grounding": acc_temporal, "spatial grounding": acc_spatial,
    "spatial-temporal grounding": acc_st, "tracking": acc_tracking, "code": acc_code,
}

FORMATS = {
    "answer": re.compile(r"\s*<answer>(?:(?!<answer>).){0,5000}?</answer>\s*", re.S),
    "think_answer": re.compile(r"\s*<think>(?:(?!<think>).){0,20000}?</think>\s*<answer>(?:(?!<answer>).){0,5000}?</answer>\s*", re.S),
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
    acc_v = min(1.0, max(0.0, float(acc or 0.0)))
    overall = w_acc * acc_v + w_fmt * fmt
    return overall, {"overall": overall, "accuracy": acc_v, "format": fmt, "parse_fail": float(acc is None)}


def validate_answer(sample: dict) -> None:
    """Raise ValueError (naming the sample) when the ground truth does not fit its problem type."""
    t, gt, sid = canonical_type(sample.get("problem_type", "")), ground_truth(sample), sample.get("id", "?")
    bad = None
    if t == "multiple choice":
        opts = sample.get("options") or []
        if choice_letter(gt, opts) is None:
            bad = f"answer {gt!r} is not one of the option letters {letters(opts) or 'A-Z'}"
    elif t in ("numerical", "counting", "regression") and parse_number(gt) is None:
        bad = f"answer {gt!r} is not a number"
    elif t == "boolean" and acc_boolean(gt, {"answer": "yes"}) is None:
        bad = f"answer {gt!r} is not yes/no/true/false"
    elif t == "temporal grounding" and ((sp := as_span(parse_json(gt))) is None or sp[0] > sp[1]):
        bad = f'answer {gt[:80]!r} is not {{"time": [start, end]}} with start <= end'
    elif t == "spatial grounding" and as_box((parse_json(gt) or {}).get("boxes") if isinstance(parse_json(gt), dict) else None) is None:
        bad = f'answer {gt[:80]!r} is not {{"boxes": [x1, y1, x2, y2]}}'
    elif t == "spatial-temporal grounding" and (as_span(parse_json(gt)) is None or as_boxes(parse_json(gt)) is None):
        bad = f'answer {gt[:80]!r} is not {{"time": [s, e], "boxes": {{"<sec>": [x1, y1, x2, y2]}}}}'
    elif t == "tracking" and as_boxes(parse_json(gt)) is None:
        bad = f'answer {gt[:80]!r} is not {{"boxes": {{"<frame>": [x1, y1, x2, y2]}}}}'
    elif t not in ACCURACY:
        bad = f"unknown problem_type {sample.get('problem_type')!r} (known: {sorted(ACCURACY)} and aliases)"
    if bad:
        raise ValueError(f"sample {sid}: {bad}")

"""rewards.py: one accuracy function per problem type, `(answer, sample) -> float in [0, 1]` (None:
unparseable), in one dict, ACCURACY, scoring what a benchmark grader would score. Adding a task is
one function and one entry.

    overall, components = compute_reward(completion, sample)   # w_acc * acc + w_fmt * fmt

docs/rewards.md states every rule: answer extraction (extract_answer), the reading and score of each
problem type, hedges (wrong answers, not parse failures), ground-truth validation and the math time
limit. Unparseable answers score 0 and are counted in components["parse_fail"]. Never raises; always
in [0, 1]; linear time on the input.

With an LLM judge served over HTTP (JudgeSettings, Judge), judged_rewards scores open-ended answers
by its verdicts, in batches: failures counted, never raised (check_judge stops a run above a share).
"""

import ast
import ctypes
import difflib
import gc
import json
import math
import re
import signal
import string
import threading
import time
import urllib.error
from http.client import HTTPException
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache, partial

import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common import MAY_CHANGE_ON_RESUME, NOT_NEGATIVE, POSITIVE, UserError, fact

# VSI-Bench's margins as its code computes them, in floats
MRA_MARGINS = (1 - np.linspace(0.5, 0.95, 10)).tolist()
NUM_RTOL = 1e-2  # numerical: |pred - gt| <= NUM_RTOL * |gt|, relative at every scale
# completions are cut to their last MAX_LEN characters before any regex runs (bounded time)
MAX_LEN = 20000
MATH_TIMEOUT = 1.0  # seconds of math-verify per call (see time_limit)
# with no tag, phrase or </think>, a text of at most this many words is the answer itself
BARE_WORDS = 8
# open-ended ground truths of at most this many (ASCII) words are scored SQuAD-style
SHORT_ANSWER = 5
# code is compared on its first CODE_TOKENS normalized tokens (difflib is quadratic at worst)
CODE_TOKENS = 2000

# each problem type's other names in public datasets, as canonical_type meets them (lower case,
# single spaces): Video-MMMU/MMVU and TempCompass write multi-choice; OVO-Bench's REC is counting,
# its SSR and CRR boolean
ALIASES = {
    alias: name
    for name, aliases in {
        "multiple choice": "multiple_choice|mcq|mc|multiple-choice|multi-choice",
        "numerical": "number|numeric",
        "counting": "count|rec",
        "boolean": "binary classification|yes/no|yes_no|ssr|crr",
        "open-ended": "open_ended|free-form|free_form|video qa|video description|caption|"
        "captioning",
        "math": "mathematics",
        "code": "coding",
        "svg-code": "svg",
        "html-code": "html",
        "temporal grounding": "temporal_grounding",
        "spatial grounding": "spatial_grounding",
        "spatial-temporal grounding": "spatial_temporal_grounding",
    }.items()
    for alias in aliases.split("|")
}

# ---- extraction: str.find and bounded repeats only (no nested quantifiers), on length-capped input
_TAG = re.compile(r"<\s{0,9}(/?)\s{0,9}(answer|think)\s{0,9}>", re.I)
_PHRASE = re.compile(
    r"(?:final answer|answer is|答案是|答案为)(?: is)?[\s:：*]{0,6}([^\n]{1,1000})", re.I
)


def canon_tags(text: str) -> str:
    """`< Answer >`, `</THINK >` -> `<answer>`, `</think>`: every later step matches the tags
    exactly."""
    return _TAG.sub(lambda m: f"<{m[1]}{m[2].lower()}>", text)


def blank(text: str) -> bool:
    """Nothing visible: only spaces, zero-width characters (format chars), NULs."""
    return not any(c.isprintable() and not c.isspace() for c in text)


def strip_blocks(text: str, start: str = "<think>", end: str = "</think>") -> str:
    """Remove every closed start...end block (leftmost first, like a lazy regex, but linear) and all
    from an unclosed start on: the text of an unfinished <think> is reasoning, not an answer."""
    out = []
    i = 0  # the end of the last block
    j = text.find(start)
    while j >= 0:
        out.append(text[i:j])
        k = text.find(end, j + len(start))
        if k < 0:
            return "".join(out)
        i = k + len(end)
        j = text.find(start, i)
    return "".join(out) + text[i:]


def last_answer(text: str, default: str | None = None) -> str | None:
    """Content of the last closed <answer>...</answer> (for nested tags, the innermost one),
    stripped; else default."""
    k = text.rfind("</answer>")
    if k < 0:
        return default
    j = text.rfind("<answer>", 0, k)
    if j < 0:
        return default
    return text[j + 8 : text.find("</answer>", j)].strip()


def answer_text(text: str) -> str:
    """The last <answer>'s content, else the whole text, without <think> blocks: where evaluate.py's
    readers start."""
    body = strip_blocks(canon_tags((text or "")[-MAX_LEN:]))
    return last_answer(body, body.strip())


def boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced, \\text{} unwrapped; None if unclosed or
    empty."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth = 1
    for j in range(i + 7, min(len(text), i + 1007)):
        if text[j] == "{":
            depth += 1
        if text[j] == "}":
            depth -= 1
        if depth == 0:
            content = re.sub(r"^\\text\{(.*)\}$", r"\1", text[i + 7 : j].strip(), flags=re.S)
            return content.strip() or None
    return None


def extract_answer(text: str) -> str | None:
    """The answer of a completion (docs/rewards.md), None when there is none."""
    text = canon_tags((text or "")[-MAX_LEN:])
    body = strip_blocks(text)
    ans = last_answer(body, boxed(body))
    if ans is None:
        hits = _PHRASE.findall(body)
        if hits:
            ans = hits[-1].strip().rstrip(".")
    # reasoning, then the answer as it is: a stray </think> (the <think> was in the prompt) ends the
    # reasoning
    if ans is None and "</think>" in text:
        ans = body.rpartition("</think>")[2]
    bare = len(body.split()) <= BARE_WORDS and len(body) <= 20 * BARE_WORDS
    # a broken tag or box is not bare
    if ans is None and bare and "answer>" not in body and "\\boxed" not in body:
        ans = body
    if ans is None or blank(ans):
        return None
    return ans.strip()


def ground_truth(sample: dict) -> str:
    """The sample's answer, the content of its <answer> tags where it has them."""
    text = canon_tags(str(sample.get("answer", "")))
    return last_answer(text, text.strip())


def canonical_type(problem_type: str) -> str:
    """A problem type lower-cased, spaces collapsed, an alias (ALIASES) as the name ACCURACY
    knows."""
    t = " ".join(str(problem_type).strip().lower().split())
    return ALIASES.get(t, t)


# ---- parsers (None on failure, never raise) ------------------------------------------------------
_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen"
).split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
WORDS = {w: i for i, w in enumerate(_ONES)}  # number words: their values
WORDS |= {w: 10 * i for i, w in enumerate(_TENS, 2)}
SCALES = {"%": 0.01, "k": 1e3, "hundred": 1e2, "thousand": 1e3, "million": 1e6, "billion": 1e9}
_DASHES = str.maketrans(
    dict.fromkeys("\u2212\u2010\u2011\u2012\u2013\u2014\u2015\ufe63\uff0d", "-")
)
# 1 \times 10^3 -> 1e3
_TIMES = re.compile(r"\s{0,2}(?:\\times|×|\\cdot|\*)\s{0,2}10\s{0,2}\^\s{0,2}\{?([-+]?\d+)\}?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]{1,30})\}\{([^{}]{1,30})\}")  # \frac{1}{2} -> 1/2
# a sign only where it is not a hyphen ("12.3s-25.7s", "999-1001" are ranges); thousands separators;
# a fraction; a percent sign, a k suffix or a scale word
_NUM = re.compile(
    r"((?<![0-9a-z.])[-+])?(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(e[-+]?\d+)?"
    r"(?:\s{0,2}/\s{0,2}(\d+(?:\.\d+)?))?(\s{0,2}%|k\b|\s{1,2}(?:thousand|million|billion)\b)?"
)
_UNITS = "|".join(sorted(WORDS, key=len, reverse=True))  # longest first: "seventeen" before "seven"
# a run of number words opens with a unit ("3 thousand" is read by _NUM): "twenty-one", "one
# thousand two hundred"
_WORD_RUN = re.compile(rf"\b(?:{_UNITS})\b(?:[ -](?:{_UNITS}|hundred|thousand|million|billion)\b)*")
# "3 or 4", "3, 4", "3-4", "between 3 and 4"
_HEDGE_GAP = re.compile(r"[\s,/~-]{0,5}(?:(?:or|and|to)[\s,/~-]{1,5})?")
_JSON_CHAR = re.compile(r'[{}\[\]"]')
_JSON_STR_END = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"?', re.S)  # a string past its opening quote
POLAR = {"yes": 1, "true": 1, "no": 0, "false": 0}


def number_text(s: str) -> str:
    """Lower-cased, dashes made "-", LaTeX products and fractions rewritten (idempotent)."""
    return _FRAC.sub(r"\1/\2", _TIMES.sub(r"e\1", s.lower().translate(_DASHES)))


def number_spans(s: str) -> list[tuple[int, int, float]]:
    """(start, end, value) in number_text(s) of every finite number, in order ("50%", "2.5k":
    docs/rewards.md)."""
    s = number_text(s)
    out = []
    for m in _NUM.finditer(s):
        value = float((m[1] or "") + m[2].replace(",", "") + (m[3] or ""))
        denominator = float(m[4] or 1)  # a fraction: "3/4"
        if denominator:
            value /= denominator
        else:
            value = math.nan  # "3/0" is no number
        scale = SCALES.get((m[5] or "").strip(), 1)
        out.append((m.start(), m.end(), value * scale))
    for m in _WORD_RUN.finditer(s):  # "one thousand two hundred": total 1000, then current 2 -> 200
        total = 0
        current = 0
        for w in m[0].replace("-", " ").split():
            if w in WORDS:
                current += WORDS[w]
            elif w == "hundred":
                current = max(current, 1) * 100
            else:
                total += max(current, 1) * SCALES[w]
                current = 0
        out.append((m.start(), m.end(), float(total + current)))
    return sorted(x for x in out if math.isfinite(x[2]))


def committed_number(s: str) -> float | None:
    """The first number; NaN (equal to nothing) for a hedge ("3 or 4", "3-4", "between 3 and 4");
    None if none."""
    s = number_text(s)
    spans = number_spans(s)
    for (_, end, v1), (start, _, v2) in zip(spans, spans[1:]):
        gap = s[end:start]
        if v1 != v2 and (_HEDGE_GAP.fullmatch(gap) or re.search(r"\bor\b", gap[:40])):
            return math.nan
    return spans[0][2] if spans else None


def parse_json(s: str):
    """The LAST complete top-level {...} or [...] in s that json.loads (a model correcting itself
    writes its final answer last); None if none. One scan over brackets and quotes: linear time."""
    spans = []
    depth = 0
    start = 0  # the outermost open bracket
    m = _JSON_CHAR.search(s)
    while m:
        c = m[0]
        i = m.end()  # the scan position
        # a string, skipped whole; quotes in prose, outside any bracket, open no string
        if c == '"' and depth > 0:
            i = _JSON_STR_END.match(s, i).end()
        elif c in "{[":
            if depth == 0:
                start = m.start()
            depth += 1
        elif depth > 0 and c in "}]":
            depth -= 1
            if depth == 0:
                spans.append((start, i))
        m = _JSON_CHAR.search(s, i)
    for a, b in reversed(spans):
        try:
            return json.loads(s[a:b])
        # JSONDecodeError is a ValueError; deep nesting recurses
        except (ValueError, RecursionError):
            pass
    return None


def as_float(v) -> float | None:
    """A JSON number or a string holding one ("12.3"); not a bool, NaN, inf or 10**400."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    ok = type(v) is float and math.isfinite(v) or type(v) is int and abs(v) < 1e300
    if not ok:
        return None
    return float(v)


def as_span(x) -> list[float] | None:
    """x["time"] or x as [start, end] with start <= end, else None."""
    if isinstance(x, dict):
        x = x.get("time")
    if not isinstance(x, (list, tuple)) or len(x) != 2:
        return None
    t = [as_float(v) for v in x]
    if None in t or t[0] > t[1]:
        return None
    return t


def as_box(b) -> list[float] | None:
    """b["boxes"] or b as [x1, y1, x2, y2], x1 <= x2, y1 <= y2 ([x, y, w, h] fails), else None."""
    if isinstance(b, dict):
        b = b.get("boxes")
    if isinstance(b, list) and len(b) == 1:  # [[x1, y1, x2, y2]]: a list of one box
        b = b[0]
    if not isinstance(b, (list, tuple)) or len(b) != 4:
        return None
    b = [as_float(v) for v in b]
    if None in b or b[0] > b[2] or b[1] > b[3]:
        return None
    return b


def text_numbers(ans: str, n: int) -> list[float] | None:
    """The first n numbers of a text that is no JSON: "from 12.3 to 25.7 seconds", "(1, 2, 3,
    4)"."""
    if parse_json(ans) is not None:
        return None
    spans = number_spans(ans)
    if len(spans) < n:
        return None
    return [v for _, _, v in spans[:n]]


def frame_key(k: str) -> str:
    """A frame as a number where it is one ("1" is "1.0"), else as written."""
    value = as_float(k)
    if value is None:
        return k
    return repr(value)


def as_boxes(x) -> dict | None:
    """{frame_key: box, or None when malformed}; None without a non-empty dict of boxes."""
    if not isinstance(x, dict):
        return None
    b = x.get("boxes")
    if not isinstance(b, dict) or not b:
        return None
    return {frame_key(k): as_box(v) for k, v in b.items()}


# ---- scorers: shared with evaluate.py ------------------------------------------------------------
def iou_1d(a, b) -> float:
    """Intersection over union of two spans [start, end]; two equal empty spans match."""
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(a[1], b[1]) - min(a[0], b[0])
    return inter / union if union > 0 else float(a == b)


def iou_box(a, b) -> float:
    """Intersection over union of two boxes as as_box returns them (x1 <= x2, y1 <= y2); two equal
    empty boxes match, as in iou_1d."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - ix * iy
    if union <= 0:
        return float(a == b)
    return ix * iy / union


def mra(pred: float, gt: float) -> float:
    """Mean relative accuracy (VSI-Bench): the share of margins m in MRA_MARGINS with |pred - gt| /
    |gt| <= m."""
    rel = abs(pred - gt) / max(abs(gt), 1e-9)
    return sum(rel <= m for m in MRA_MARGINS) / len(MRA_MARGINS)


def squad_norm(s: str) -> str:
    """SQuAD's normalize_answer: lower case, punctuation removed, articles (a, an, the) removed,
    spaces collapsed."""
    s = "".join(c for c in s.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def token_f1(pred: str, ref: str) -> float:
    """SQuAD's F1 over squad_norm tokens: 1.0 exactly when the normalized texts match (its exact
    match)."""
    p = squad_norm(pred).split()
    r = squad_norm(ref).split()
    if not p or not r:
        return float(p == r)
    same = sum((Counter(p) & Counter(r)).values())
    return 0.0 if same == 0 else 2 * same / (len(p) + len(r))


@lru_cache(maxsize=1)
def rouge_scorer():
    """rouge-score's scorer, built at first use: its import loads nltk (0.7 s in every process that
    imports us)."""
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge(pred: str, ref: str) -> float:
    """Mean ROUGE-1/2/L F1 by rouge-score (ASCII words, Porter-stemmed)."""
    scores = rouge_scorer().score(ref[:MAX_LEN], pred[:MAX_LEN])
    return sum(x.fmeasure for x in scores.values()) / 3


def wer(pred: str, ref: str) -> float:
    """Word error rate: the word-level edit distance over the reference's length (first 2000
    words)."""
    p = pred.lower().split()[:2000]
    r = ref.lower().split()[:2000]
    if p == r or not r:  # equal: a ground truth validated against itself skips the table
        return float(p != r)
    prev = list(range(len(r) + 1))
    for i, x in enumerate(p, 1):
        cur = [i]
        for j, y in enumerate(r, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1] / len(r)


# ---- accuracy rewards -------------------------------------------------------------------------
# (answer extracted from the completion, sample) -> float, or None when unparseable
_LEAD = re.compile(
    r"\s{0,3}(?:(?:the\s{1,3})?(?:final\s{1,3}|correct\s{1,3}|best\s{1,3})?"
    r"(?:answer|option|choice)\b"
    r"(?:\s{1,3}is)?|答案(?:是|为)?)\s{0,3}[:：]?",
    re.I,
)
_MARKUP = re.compile(r"\\(?:boxed|text|textbf|mathrm)\{|[*${}]")
_LETTER = re.compile(r"(?<![A-Za-z0-9'’])(?:\(([A-Za-z])\)|([A-Z])(?![A-Za-z0-9'’]))")
_WORD_NEXT = re.compile(r"[ \t]{1,3}(?!(?:and|or)\b)[a-z]")  # "A dog", "I think"; not "A or B"


def option_table(options: list[str]) -> list[tuple[str, str]]:
    """[(letter, text)] from "A. red" / "A) red" / "(A) red"; an option without a letter gets its
    position's."""
    table = []
    for i, o in enumerate(options or []):
        m = re.match(r"\s*\(?([A-Za-z])[.):]\s*(.*)", o, re.S)
        if m:
            table.append((m.group(1).upper(), m.group(2)))
        else:
            table.append((chr(65 + i % 26), o))
    return table


def known_letter(letter: str, letters: set) -> str | None:
    """The letter upper-cased where it is one of the options', else None."""
    if letter.upper() in letters:
        return letter.upper()
    return None


def choice_letter(ans: str, options: list[str]) -> str | None:
    """The option letter an answer names (the order of reading: docs/rewards.md); a hedge joined
    ("A+B"); else None."""
    table = option_table(options)
    letters = {lt for lt, _ in table} or set(string.ascii_uppercase)
    s = _MARKUP.sub(" ", ans)
    lead_in = _LEAD.match(s)  # "the answer is", "答案是"
    if lead_in:
        s = s[lead_in.end() :]
    s = s.strip()
    bare = re.fullmatch(r"\(?([A-Za-z])\)?[.):]?", s)  # "B", "(B)", "B."
    if bare:
        return known_letter(bare[1], letters)
    text = squad_norm(s)
    for lt, body in table:
        if text and text == squad_norm(body):
            return lt
    lead = re.match(r"\(([A-Za-z])\)|([A-Za-z])[.):]", s)  # "(B) red", "B. red"
    if lead:
        return known_letter(lead[1] or lead[2], letters)
    found = set()
    for m in _LETTER.finditer(s):
        if not (m[2] in ("A", "I") and _WORD_NEXT.match(s, m.end())):
            found.add((m[1] or m[2]).upper())
    return "+".join(sorted(found & letters)) or None


def acc_choice(ans, s):
    got = choice_letter(ans, s.get("options"))  # no options: option_table's []
    if got is None:
        return None
    if len(got) > 1:  # "A+B": a hedge
        return 0.0
    return float(got == choice_letter(ground_truth(s), s.get("options")))


def acc_number(ans, s, rtol: float = NUM_RTOL, mean_relative: bool = False):
    """|pred - gt| <= rtol * |gt| (exact when gt is 0), or mra(pred, gt) with mean_relative; a hedge
    (NaN) is 0."""
    p = committed_number(ans)
    g = committed_number(ground_truth(s))
    if p is None:
        return None
    if mean_relative:
        return mra(p, g)
    return float(abs(p - g) <= rtol * abs(g) * (1 + 1e-9))  # 1.01 vs 1: on the edge


def polarity(ans: str) -> float | None:
    """1 for yes/true, 0 for no/false: the first such word, flipped after "not"; NaN (equal to
    nothing) for a hedge ("Yes and no", "yes/no"; "Yes, but no other person does." is yes); None
    when there is none."""
    words = re.findall(r"\w+", ans.lower())
    i = next((k for k, w in enumerate(words) if w in POLAR), None)
    if i is None:
        return None
    # the next word within 3 that is no filler: "yes and no", "yes or maybe no"
    rest = [
        w for w in words[i + 1 : i + 4] if w not in ("and", "or", "maybe", "perhaps", "possibly")
    ]
    if rest and rest[0] in POLAR and POLAR[rest[0]] != POLAR[words[i]]:
        return math.nan
    return POLAR[words[i]] ^ (i > 0 and words[i - 1] == "not")


def acc_boolean(ans, s):
    p = polarity(ans)
    if p is None:
        return None
    return float(p == polarity(ground_truth(s)))


def acc_open(ans, s):
    gt = ground_truth(s)
    if len(re.findall(r"[a-z0-9]+", gt.lower())) <= SHORT_ANSWER:  # as rouge-score counts words
        return token_f1(ans, gt)
    return rouge(ans, gt)


def acc_ocr(ans, s):
    gt = ground_truth(s)
    # WER >= (n_pred - n_ref) / n_ref >= 1: skip the O(n * m) table
    if len(ans.split()) >= 2 * len(gt.split()):
        return 0.0
    return max(0.0, 1.0 - wer(ans, gt))


class MathTimeout(BaseException):
    """A BaseException: math-verify's own `except Exception` can't swallow it."""


_ASYNC_RAISE = ctypes.pythonapi.PyThreadState_SetAsyncExc
_ARM_LOCK = threading.Lock()


class time_limit:
    """`with time_limit(seconds):` raises MathTimeout in this thread after `seconds`, then every 50
    ms until the block ends: a SIGALRM timer in the main thread, a watchdog thread elsewhere, the gc
    off (why: docs/rewards.md)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.done = threading.Event()
        self.tid = threading.get_ident()
        self.main = threading.current_thread() is threading.main_thread()
        self.armed = not self.main  # the main thread arms once its handler is in place

    def alarm(self, signum, frame):
        """SIGALRM's handler. A late alarm is a no-op: after the work, or on entering __exit__
        before it disarms (there it would skip __exit__ and leave the timer raising MathTimeout
        anywhere; seen under heavy load)."""
        if self.armed and getattr(frame, "f_code", None) is not time_limit.__exit__.__code__:
            raise MathTimeout

    def watchdog(self):
        """Raises MathTimeout in the worker thread, from its own thread."""
        wait = self.seconds
        while not self.done.wait(wait) and self.armed:
            # injects only while armed: __exit__ disarms, then clears under the same lock
            with _ARM_LOCK:
                if self.armed:
                    _ASYNC_RAISE(ctypes.c_ulong(self.tid), ctypes.py_object(MathTimeout))
            wait = 0.05

    def __enter__(self):
        self.gc_on = gc.isenabled()
        gc.disable()
        if self.main:
            self.old = signal.signal(signal.SIGALRM, self.alarm)
            self.armed = True
            signal.setitimer(signal.ITIMER_REAL, self.seconds, 0.05)
        else:
            threading.Thread(target=self.watchdog, daemon=True).start()

    def __exit__(self, *exc):
        # first: a plain store, where no signal handler runs and no async exception lands
        self.armed = False
        if self.main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if self.old is None else self.old)
        else:
            with _ARM_LOCK:
                # drop one injected but not yet delivered
                _ASYNC_RAISE(ctypes.c_ulong(self.tid), None)
            self.done.set()
        if self.gc_on:
            gc.enable()


@lru_cache(maxsize=1)
def _math_warm() -> bool:
    """sympy's first symbolic compare imports lazily for ~0.3 s: done once, not on the clock."""
    from math_verify import parse, verify

    return verify(parse("$2x$"), parse("$x + x$"))


@lru_cache(maxsize=4096)
def _math_gold(gt: str):
    """The parsed ground truth; [] where math-verify reads only text (no answer but that very text
    would equal it)."""
    from math_verify import parse

    gold = parse(f"${gt}$", parsing_timeout=None)
    if any(not isinstance(x, str) for x in gold):
        return gold
    return []


def acc_math(ans, s):
    """math-verify's equivalence; its own timeouts (whole-second, main-thread alarms) are off:
    time_limit bounds both the parse and the compare."""
    from math_verify import parse, verify

    _math_warm()
    try:
        with time_limit(MATH_TIMEOUT):
            gold = _math_gold(ground_truth(s))
            pred = parse(f"${ans[:2000]}$", parsing_timeout=None)
            return float(bool(pred) and verify(gold, pred, timeout_seconds=None))
    # math-verify raises a zoo of sympy errors: all mean "not equal"
    except (Exception, MathTimeout):  # noqa: BLE001
        return 0.0


def acc_temporal(ans, s):
    """IoU of the predicted span (JSON, else "from 12.3 to 25.7 seconds") with the ground
    truth's."""
    p = as_span(parse_json(ans)) or as_span(text_numbers(ans, 2))
    if p is None:
        return None
    return iou_1d(p, as_span(parse_json(ground_truth(s))))


def acc_spatial(ans, s):
    """IoU of the predicted box (JSON, a bare list, else "(1, 2, 3, 4)") with the ground truth's,
    which must be {"boxes": ...}."""
    p = as_box(parse_json(ans)) or as_box(text_numbers(ans, 4))
    if p is None:
        return None
    return iou_box(p, as_box(parse_json(ground_truth(s))["boxes"]))


def mean_box_iou(pred: dict, gt: dict, frames) -> float:
    """Mean box IoU over frames; a missing or malformed predicted box counts 0."""
    return sum(iou_box(pred[k], gt[k]) for k in frames if pred.get(k)) / max(len(frames), 1)


def acc_st(ans, s):
    """Half time IoU, half mean box IoU (EasyVideoR1's spatial-temporal grounding)."""
    x = parse_json(ans)
    g = parse_json(ground_truth(s))
    span = as_span(x)
    boxes = as_boxes(x)
    if span is None and boxes is None:
        return None
    time_iou = 0.0
    if span is not None:
        time_iou = iou_1d(span, as_span(g))
    # 71 of STVG's 2,000 have no boxes: time IoU alone, as EasyVideoR1 scores them
    if isinstance(g, dict) and g.get("boxes") == {}:
        return time_iou
    if boxes is None:
        return 0.5 * time_iou
    # over the frames both have (EasyVideoR1, STVG): frames off the predicted span cost time IoU
    gt = as_boxes(g)
    return 0.5 * time_iou + 0.5 * mean_box_iou(boxes, gt, boxes.keys() & gt.keys())


def acc_tracking(ans, s):
    boxes = as_boxes(parse_json(ans))
    if boxes is None:
        return None
    gt = as_boxes(parse_json(ground_truth(s)))
    return mean_box_iou(boxes, gt, gt)  # over the ground truth's frames (docs/rewards.md)


_MARKUP_TAG = re.compile(r"<(/?)([A-Za-z][\w:.-]{0,63})([^<>]{0,2000})>")
_ATTR = re.compile(
    r"""([\w:.-]{1,64})(?:\s{0,3}=\s{0,3}("[^"]{0,2000}"|'[^']{0,2000}'|[^\s"'>]{1,2000}))?"""
)
BINDS = {
    ast.Name: "id",
    ast.arg: "arg",
    ast.FunctionDef: "name",
    ast.AsyncFunctionDef: "name",
    ast.ClassDef: "name",
}


def markup_tokens(text: str) -> list[str]:
    """HTML/SVG as tokens: tags (lower-cased), their attributes sorted, words; no comments
    (docs/rewards.md)."""
    text = strip_blocks(text, "<!--", "-->")
    tokens = []
    i = 0  # the end of the last tag
    for m in _MARKUP_TAG.finditer(text):
        tag = m[2].lower()
        attrs = sorted(
            (k.lower(), " ".join(v.strip("\"'").split())) for k, v in _ATTR.findall(m[3])
        )
        tokens += text[i : m.start()].split()
        if m[1]:
            tokens.append(f"</{tag}")
        else:
            tokens += [f"<{tag}", *(f"{k}={v}" for k, v in attrs)]
        if m[3].rstrip().endswith("/"):  # <x/> is <x></x>
            tokens.append(f"</{tag}")
        i = m.end()
    return tokens + text[i:].split()


def python_tokens(code: str) -> list[str] | None:
    """Tokens of ast.unparse(code), bound names (assigned, defined, arguments) renamed v0, v1, ...;
    None if no parse."""
    try:
        tree = ast.parse(code)
        names = {}
        for node in ast.walk(tree):
            field = BINDS.get(type(node))
            if field and (field != "id" or isinstance(node.ctx, ast.Store)):
                names.setdefault(getattr(node, field), f"v{len(names)}")
        for node in ast.walk(tree):
            field = BINDS.get(type(node))
            if field and getattr(node, field) in names:
                setattr(node, field, names[getattr(node, field)])
        return re.findall(r"\w+|[^\w\s]", ast.unparse(tree))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def unfenced(code: str) -> str:
    """The code without its Markdown fence (```python ... ```)."""
    return re.sub(r"^```\w*\n?|```$", "", code.strip()).strip()


def acc_code(ans, s, markup: bool = False):
    """difflib ratio of python_tokens (markup_tokens: markup, or a reference opening "<"); 0 if one
    is empty."""
    code = unfenced(ans)
    ref = unfenced(ground_truth(s))
    tokens = python_tokens
    if markup or ref.startswith("<"):
        tokens = markup_tokens
    pred = tokens(code)
    gold = tokens(ref)
    if not pred or not gold:
        return 0.0
    matcher = difflib.SequenceMatcher(None, pred[:CODE_TOKENS], gold[:CODE_TOKENS], autojunk=False)
    return matcher.ratio()


ACCURACY = {
    "multiple choice": acc_choice,
    "numerical": acc_number,
    "counting": partial(acc_number, rtol=0.0),
    "regression": partial(acc_number, mean_relative=True),
    "boolean": acc_boolean,
    "open-ended": acc_open,
    "ocr": acc_ocr,
    "math": acc_math,
    "temporal grounding": acc_temporal,
    "spatial grounding": acc_spatial,
    "spatial-temporal grounding": acc_st,
    "tracking": acc_tracking,
    "code": acc_code,
    "svg-code": partial(acc_code, markup=True),
    "html-code": partial(acc_code, markup=True),
}
GT_FORMS = {  # what a ground truth must be, for validate_answer's message
    "multiple choice": "one of the option letters",
    "numerical": "one number",
    "counting": "one number",
    "regression": "one number",
    "boolean": "yes/no/true/false",
    "temporal grounding": '{"time": [start, end]} with start <= end',
    "spatial grounding": '{"boxes": [x1, y1, x2, y2]} with x1 <= x2, y1 <= y2',
    "spatial-temporal grounding": (
        '{"time": [s, e], "boxes": {"<sec>": [x1, y1, x2, y2]}} with s <= e'
    ),
    "tracking": '{"boxes": {"<frame>": [x1, y1, x2, y2]}} with x1 <= x2, y1 <= y2',
    "code": "Python that parses, or markup",
    "math": "an expression math-verify parses",
}
_ANSWER = r"<answer>(?:(?!</?answer>).){0,5000}</answer>\s*"
FORMATS = {
    "answer": re.compile(r"\s*" + _ANSWER, re.S),
    "think_answer": re.compile(r"\s*<think>(?:(?!</?think>).){0,20000}</think>\s*" + _ANSWER, re.S),
}


def format_reward(completion: str, template: str = "answer") -> float:
    """1 if the whole completion is exactly the template (one answer block) and the answer holds
    something visible."""
    c = (completion or "")[:MAX_LEN]
    ok = FORMATS[template].fullmatch(c) is not None and c.count("<answer>") == 1
    return float(ok and not blank(c[c.find("<answer>") + 8 : c.find("</answer>")]))


# what a malformed *prediction* the parser let through (or a malformed ground truth) raises in a
# rule
MALFORMED = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    ZeroDivisionError,
    RecursionError,
    OverflowError,
)


def accuracy(answer: str, sample: dict) -> float | None:
    """ACCURACY of the sample's problem type (unknown types: open-ended); None when the answer is
    unparseable."""
    try:
        rule = ACCURACY.get(canonical_type(sample.get("problem_type", "")), acc_open)
        return rule(answer, sample)
    except MALFORMED:
        return None


def compute_reward(
    completion: str,
    sample: dict,
    w_acc: float = 0.9,
    w_fmt: float = 0.1,
    format_template: str = "answer",
) -> tuple[float, dict]:
    """(overall, {"overall", "accuracy", "format", "parse_fail"}); a parse failure scores accuracy
    0."""
    ans = extract_answer(completion)
    acc = None
    if ans is not None:
        acc = accuracy(ans, sample)
    fmt = format_reward(completion, format_template)
    acc_v = 0.0  # unparseable, or NaN
    if acc is not None and math.isfinite(acc):
        acc_v = min(1.0, max(0.0, float(acc)))
    overall = w_acc * acc_v + w_fmt * fmt
    return overall, {
        "overall": overall,
        "accuracy": acc_v,
        "format": fmt,
        "parse_fail": float(acc is None),
    }


def validate_answer(sample: dict) -> None:
    """Raise ValueError (naming the sample) unless the ground truth, given back as the answer,
    scores 1."""
    t = canonical_type(sample.get("problem_type", ""))
    gt = ground_truth(sample)
    sid = sample.get("id", "?")
    if t not in ACCURACY:
        raise ValueError(
            f"sample {sid}: unknown problem_type {sample.get('problem_type')!r} "
            f"(known: {sorted(ACCURACY)} and aliases)"
        )
    if not gt or accuracy(gt, sample) != 1.0:
        what = GT_FORMS.get(t, f"a non-empty {t} answer")
        if t == "multiple choice":
            what += f" {[lt for lt, _ in option_table(sample.get('options'))] or 'A-Z'}"
        raise ValueError(f"sample {sid}: answer {gt[:80]!r} is not {what}")


# --------------------------------------------------------------------------------------------------
# The LLM judge: open-ended answers scored by a model behind an OpenAI-compatible chat API (docs/rewards.md)

JUDGED = ("open-ended",)  # the problem types the judge scores when judge_url is set
# the verdict: the reply's LAST "Judgement: x", x a number in [0, 1] (evaluate.py's benchmarks ask for 0/1)
_VERDICT = re.compile(r"judgement\s{0,9}:\s{0,9}(\d{1,9}(?:\.\d{1,9})?)", re.I)
# judged_rewards' components (0/1 each): asked, failed (no reply; no verdict), answered from the cache
JUDGE_KEYS = ("judged", "judge_error", "judge_parse_fail", "judge_cached")
# what another try may cure; other HTTP errors (404: a wrong judge_model) are final
RETRIED_HTTP = (408, 429, 500, 502, 503, 504)


@dataclass
class JudgeSettings:
    """train.Config's judge fields (evaluate.py builds one from its own)."""

    judge_url: str = fact("", MAY_CHANGE_ON_RESUME)
    """OpenAI-compatible API base of an LLM judge (http://host:port/v1): it scores the open-ended answers,
    not the rules (docs/rewards.md) ('' = off)"""
    judge_model: str = ""
    """the model name the judge server serves"""
    judge_template: str = "configs/judge.jinja"
    """Jinja2 file of the judge's prompt: {{ question }}, {{ reference }}, {{ answer }}"""
    judge_timeout: float = fact(60.0, POSITIVE, MAY_CHANGE_ON_RESUME)
    """seconds one request may take"""
    judge_retries: int = fact(2, NOT_NEGATIVE, MAY_CHANGE_ON_RESUME)
    """tries after a failed one (connection, timeout, HTTP 408/429/5xx, a malformed body)"""
    judge_workers: int = fact(16, POSITIVE, MAY_CHANGE_ON_RESUME)
    """concurrent requests"""
    judge_max_tokens: int = fact(256, POSITIVE)
    """the longest reply"""
    judge_regex: str = ""
    """vLLM's structured output: the reply is made to match it, e.g. 'Judgement: [01]' ('' = free)"""
    judge_max_fail: float = fact(0.2, NOT_NEGATIVE, MAY_CHANGE_ON_RESUME)
    """a step whose judged answers failed (judge_error, judge_parse_fail) above this share stops the run"""


@dataclass(frozen=True)
class JudgeItem:
    """What the judge is asked about, and the cache's key."""

    question: str
    reference: str
    answer: str


@dataclass
class Verdict:
    """The judge's score in [0, 1], or None and why: "judge_error" (no usable reply after the retries)
    or "parse_fail" (a reply without a verdict); detail: the error or the reply's end."""

    score: float | None
    error: str = ""
    detail: str = ""
    cached: bool = False
    reply: str = ""
    """the judge's text ('' after an error)"""


def verdict(reply: str) -> Verdict:
    """The reply's last "Judgement: x" with 0 <= x <= 1, else a parse failure."""
    found = _VERDICT.findall(reply[-MAX_LEN:])
    if found and float(found[-1]) <= 1:
        return Verdict(float(found[-1]))
    return Verdict(None, "parse_fail", reply[-200:])


class Judge:
    """A client of the judge (JudgeSettings): a batch of items in, one Verdict each out, never an
    exception; requests concurrent (judge_workers threads), each under judge_timeout with up to
    judge_retries more tries; scores cached by item. counts: requests, cache_hit, judge_error,
    parse_fail, and the last error."""

    def __init__(self, settings: JudgeSettings, template: str = ""):
        self.s = settings
        # Jinja2 source ('' = none: the caller gives the prompts), sandboxed as data.py's templates
        self.template = ImmutableSandboxedEnvironment(autoescape=False).from_string(template)
        self.cache: dict[JudgeItem, Verdict] = {}  # scored verdicts, their replies kept
        self.counts = Counter()
        self.last_error = ""
        self.lock = threading.Lock()

    def render(self, item: JudgeItem) -> str:
        return self.template.render(
            question=item.question, reference=item.reference, answer=item.answer
        )

    def __call__(self, items: list[JudgeItem], prompts: list[str] | None = None) -> list[Verdict]:
        """Verdicts on the items (prompts: the rendered template's by default); each distinct item
        asked once, a cached one not at all."""
        if prompts is None:
            prompts = [self.render(it) for it in items]
        todo = {it: p for it, p in zip(items, prompts) if it not in self.cache}
        found = {}
        if todo:
            with ThreadPoolExecutor(min(self.s.judge_workers, len(todo))) as pool:
                found = dict(zip(todo, pool.map(self.ask, todo.values())))
        out = []
        for it in items:
            if it in self.cache:  # before, or a repeat in this batch
                v = replace(self.cache[it], cached=True)
            else:
                v = found[it]
                if v.score is not None:
                    self.cache[it] = v
            self.counts["cache_hit"] += v.cached
            out.append(v)
        return out

    def ask(self, prompt: str | list[dict]) -> Verdict:
        """One item (a user text, or a whole conversation): a request with retries (exponential
        back-off), then its reply's verdict."""
        messages = prompt
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        body = {
            "model": self.s.judge_model,
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.s.judge_max_tokens,
        }
        if self.s.judge_regex:
            body["structured_outputs"] = {"regex": self.s.judge_regex}
        request = urllib.request.Request(
            self.s.judge_url.rstrip("/") + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        for attempt in range(self.s.judge_retries + 1):
            if attempt:
                time.sleep(min(5.0, 0.2 * 2**attempt))
            with self.lock:
                self.counts["requests"] += 1
            try:
                with urllib.request.urlopen(request, timeout=self.s.judge_timeout) as r:
                    reply = json.loads(r.read())["choices"][0]["message"]["content"]
                v = verdict(str(reply))
                v.reply = str(reply)
                break
            except urllib.error.HTTPError as e:
                v = Verdict(None, "judge_error", f"HTTP {e.code} {e.reason}")
                if e.code not in RETRIED_HTTP:
                    break
            except (OSError, HTTPException, ValueError, LookupError, TypeError) as e:  # net, body
                v = Verdict(None, "judge_error", f"{type(e).__name__}: {e}")
        with self.lock:
            self.counts[v.error or "ok"] += 1
            if v.error:
                self.last_error = f"{v.error}: {v.detail}"
        return v


def judge_problems(s: JudgeSettings) -> list[str]:
    """What in the judge settings cannot work (train.check_config's lines)."""
    bad = []
    if not s.judge_url.startswith(("http://", "https://")):
        bad.append(f"judge_url {s.judge_url!r} must start with http:// or https://")
    if not s.judge_model:
        bad.append("judge_url needs judge_model (the name the server serves)")
    try:
        Judge(s, open(s.judge_template).read()).render(JudgeItem("q", "r", "a"))
    except Exception as e:  # noqa: BLE001 - a missing file, a syntax error, a sandbox refusal
        bad.append(f"judge_template {s.judge_template}: {type(e).__name__}: {e}")
    return bad


def judged_rewards(
    judge: Judge,
    completions: list[str],
    samples: list[dict],
    w_acc: float = 0.9,
    w_fmt: float = 0.1,
    format_template: str = "answer",
) -> list[dict]:
    """compute_reward's components for each completion, the judge's score as the accuracy of the
    answers of JUDGED types, all asked in one batch, + "judged", "judge_error", "judge_parse_fail",
    "judge_cached" (0/1 each). A failed verdict keeps the rule's accuracy (docs/rewards.md)."""
    comps = [
        compute_reward(c, s, w_acc, w_fmt, format_template)[1] for c, s in zip(completions, samples)
    ]
    asked = []  # (component dict, item)
    for comp, text, s in zip(comps, completions, samples):
        comp.update(dict.fromkeys(JUDGE_KEYS, 0.0))
        ans = extract_answer(text)
        if ans is not None and canonical_type(s.get("problem_type", "")) in JUDGED:
            asked.append((comp, JudgeItem(s["problem"], ground_truth(s), ans)))
    for (comp, _), v in zip(asked, judge([item for _, item in asked])):
        comp.update(judged=1.0, judge_cached=float(v.cached))
        if v.error == "parse_fail":  # the rule's accuracy stays
            comp["judge_parse_fail"] = 1.0
        elif v.error:
            comp["judge_error"] = 1.0
        else:  # read by the judge: not a parse failure
            comp.update(accuracy=v.score, parse_fail=0.0)
        comp["overall"] = w_acc * comp["accuracy"] + w_fmt * comp["format"]
    return comps


def check_judge(components: list[dict], max_fail: float, where: str, judge: Judge) -> None:
    """UserError when the judged answers of a step failed above the max_fail share."""
    judged = sum(c.get("judged", 0.0) for c in components)
    errors = sum(c.get("judge_error", 0.0) for c in components)
    unread = sum(c.get("judge_parse_fail", 0.0) for c in components)
    if judged and (errors + unread) / judged > max_fail:
        raise UserError(
            f"{where}: the judge failed on {errors + unread:.0f} of {judged:.0f} judged answers "
            f"(judge_error {errors:.0f}, judge_parse_fail {unread:.0f}), above judge_max_fail "
            f"{max_fail} (judge_url {judge.s.judge_url}); last: {judge.last_error[:300]}"
        )

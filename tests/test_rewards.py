"""Rewards: answer extraction, one table of cases per problem type, malformed outputs, aliases, format,
weighting, ground-truth validation, a hypothesis property test and bounded time on pathological input.

    .venv/bin/python -m pytest -q tests/test_rewards.py
"""

import json
import math
import os
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewards
from rewards import canonical_type, compute_reward, extract_answer, format_reward, validate_answer

OPTIONS = ["A. cat", "B. a dog is running", "C. red car", "D. blue"]
BOX = [0, 0, 10, 10]
GT = {  # one well-formed ground truth per canonical problem type
    "multiple choice": "B",
    "numerical": "100",
    "counting": "3",
    "regression": "100",
    "boolean": "yes",
    "open-ended": "the cat is on the mat",
    "ocr": "hello world foo bar",
    "math": "\\frac{1}{2}",
    "temporal grounding": '{"time": [2, 6]}',
    "spatial grounding": '{"boxes": [0, 0, 10, 10]}',
    "spatial-temporal grounding": '{"time": [0, 4], "boxes": {"0": [0, 0, 10, 10], "1": [0, 0, 10, 10]}}',
    "tracking": '{"boxes": {"0": [0, 0, 10, 10], "1": [0, 0, 10, 10], "2": [0, 0, 10, 10]}}',
    "code": "print(1)",
    "svg-code": '<svg width="10"><rect x="1"/></svg>',
    "html-code": "<p>Hello <b>world</b></p>",
}
TYPES = sorted(GT)


def sample(ptype, answer=None, **kw):
    s = {
        "id": f"s-{ptype}",
        "problem_type": ptype,
        "answer": GT[canonical_type(ptype)] if answer is None else answer,
    }
    if canonical_type(ptype) == "multiple choice":
        s["options"] = OPTIONS
    return {**s, **kw}


def score(ptype, completion, **kw):
    return compute_reward(completion, sample(ptype, **kw))[1]


def test_every_type_has_a_case():
    assert set(TYPES) == set(rewards.ACCURACY)


# ---------------------------------------------------------------------------------------------------
# extract_answer on its own
@pytest.mark.parametrize(
    "text, want",
    [
        ("<answer>A</answer> then <answer>B</answer>", "B"),  # last <answer> wins
        ("<answer> B </answer>", "B"),
        ("<think>maybe <answer>A</answer></think><answer>B</answer>", "B"),  # <think> removed first
        ("<think>the answer is A</think> the answer is B", "B"),
        ("<think>hmm <answer>C</answer>", None),  # unclosed think: never scored
        ("<answer>A</answer><think>more", "A"),
        ("reasoning</think> 42", "42"),  # a stray </think> ends reasoning
        ("< Answer >B</ANSWER >", "B"),
        ("<ANSWER>B</answer>", "B"),
        ("<answer >B</ answer>", "B"),  # any case, spaces
        ("Final answer: 42", "42"),
        ("**Final Answer:** B", "B"),
        ("The final answer is 7.", "7"),
        ("B", "B"),
        (" red car ", "red car"),  # a bare short answer
        ("<answer>\u200b</answer>", None),
        ("<answer>\x00 \u2060</answer>", None),  # nothing visible
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),  # \boxed, nested braces
        ("\\boxed{1} and then \\boxed{{2}}", "{2}"),  # the last \boxed
        ("\\boxed{\\text{B}}", "B"),
        ("\\boxed{1} <answer>2</answer>", "2"),  # <answer> beats \boxed
        ("The answer is: 42.", "42"),  # phrase fallback
        ("I think... so the answer is B\nbecause", "B"),
        ("<think>reasoning</think>  42 ", "42"),  # text after </think>
        ("<answer><answer>B</answer></answer>", "B"),  # nested: innermost
        ("<answer>A</answer><answer>B", "A"),  # unclosed last tag ignored
        ("x" * 30000 + "<answer>B</answer>", "B"),  # long: the tail is read
        ("<answer>ＢＢ 😀</answer>", "ＢＢ 😀"),
        ("<think><answer>A</answer>", None),  # unicode; unclosed think
        ("", None),
        (None, None),
        ("plain garbage without any answer that a grader could read here", None),
        ("<answer>", None),
        ("<answer>B", None),
        ("<answer></answer>", None),
        ("<answer>  \n </answer>", None),
        ("\\boxed{}", None),
        ("\\boxed{unclosed", None),
        ("<think>the answer is A</think>", None),
    ],
)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize(
    "text, want",
    [  # the step evaluate.py shares: tag content, else the text, '' in a <think>
        ("< Answer >B</ANSWER>", "B"),
        ("<think>x</think> B ", "B"),
        ("<think>x <answer>B</answer>", ""),
        ("<answer>A</answer><think>more", "A"),
        ("plain text", "plain text"),
        ("", ""),
        (None, ""),
    ],
)
def test_answer_text(text, want):
    assert rewards.answer_text(text) == want


# ---------------------------------------------------------------------------------------------------
# table-driven cases per problem type: (type, completion's answer, ground truth or None, accuracy; None = parse failure)
# "the cat sat on the mat" vs "the cat is on the mat": R1 5/6, R2 3/5, RL 5/6
ROUGE_EX = ((5 / 6) + 0.6 + (5 / 6)) / 3
BOMB = (
    "<!DOCTYPE s [<!ENTITY a0 'xxxxxxxxxx'>"
    + "".join(f"<!ENTITY a{i} '{f'&a{i - 1};' * 10}'>" for i in range(1, 10))
    + "]><s>&a9;</s>"
)
PY_REF = "def f(x):\n    return x + 1"  # python_tokens: def v0 ( v1 ) : return v1 + 1  (10 tokens)
SVG_REF = '<svg width="10"><rect x="1"/></svg>'  # <svg width=10 <rect x=1 </rect </svg  (6 tokens)
HTML_REF = "<p>Hello <b>world</b></p>"  # <p Hello <b world </b </p  (6 tokens)
ST = "spatial-temporal grounding"  # ground truth: time [0, 4], boxes {"0", "1"}: [0, 0, 10, 10]
# one table per defect class of issue 15: (type, answer inside <answer>, ground truth or None for GT[type], accuracy a
# grader gives; None = parse failure). Rows go correct, near miss, hedge, junk.
CASES = [
    # multiple choice: the letter out of the forms models write; option text (SQuAD-normalized); hedges are wrong
    ("multiple choice", "B", None, 1.0),
    ("multiple choice", "(B)", None, 1.0),
    ("multiple choice", "b", None, 1.0),
    ("multiple choice", "B.", None, 1.0),
    ("multiple choice", "B. a dog is running", None, 1.0),
    ("multiple choice", "Option B", None, 1.0),
    ("multiple choice", "Answer: B", None, 1.0),
    ("multiple choice", "The answer is B", None, 1.0),
    ("multiple choice", "**B**", None, 1.0),
    ("multiple choice", "\\boxed{B}", None, 1.0),
    ("multiple choice", "答案是B", None, 1.0),
    ("multiple choice", "The correct option is (B).", None, 1.0),
    ("multiple choice", "I think it is B.", None, 1.0),
    ("multiple choice", "A dog is running", None, 1.0),  # option text, not letter "A"
    ("multiple choice", "a dog is running.", None, 1.0),
    ("multiple choice", "B", "<answer>B</answer>", 1.0),
    ("multiple choice", "A", None, 0.0),
    ("multiple choice", "(C) red car", None, 0.0),
    ("multiple choice", "red car", None, 0.0),
    ("multiple choice", "Option A", None, 0.0),
    ("multiple choice", "B or A", None, 0.0),
    ("multiple choice", "B, A", None, 0.0),
    ("multiple choice", "A or B", None, 0.0),
    ("multiple choice", "either (B) or (C)", None, 0.0),
    ("multiple choice", "E", None, None),
    ("multiple choice", "I think so", None, None),
    # numerical: signs survive every dash; scale words, k, LaTeX, separators, percent; relative tolerance 1%
    ("numerical", "100", None, 1.0),
    ("numerical", "There are 100.", None, 1.0),
    ("numerical", "one hundred", None, 1.0),
    ("numerical", "3", "3", 1.0),
    ("numerical", "three", "3", 1.0),
    ("numerical", "Three", "3.0", 1.0),
    ("numerical", "1/2", "0.5", 1.0),
    ("numerical", "0.5", "1/2", 1.0),
    ("numerical", "50%", "0.5", 1.0),
    ("numerical", "50 %", "0.5", 1.0),
    ("numerical", "1,000", "1000", 1.0),
    ("numerical", "1e3", "1000", 1.0),
    ("numerical", "one thousand", "1000", 1.0),
    ("numerical", "2.5k", "2500", 1.0),
    ("numerical", "1 \\times 10^3", "1000", 1.0),
    ("numerical", "\\frac{1}{2}", "0.5", 1.0),
    ("numerical", "3 million", "3000000", 1.0),
    ("numerical", "twenty-one", "21", 1.0),
    ("numerical", "ninety nine", "99", 1.0),
    ("numerical", "one thousand two hundred", "1200", 1.0),
    ("numerical", "\u22123", "-3", 1.0),
    ("numerical", "\u22123", "3", 0.0),
    ("numerical", "\u20133", "-3", 1.0),
    ("numerical", "\u20143.5", "-3.5", 1.0),
    ("numerical", "-2.5", "-2.5", 1.0),
    ("numerical", "2.5", "-2.5", 0.0),
    ("numerical", "101", "100", 1.0),
    ("numerical", "101.5", "100", 0.0),  # |pred - gt| <= 1% of |gt|
    ("numerical", "1.01", "1", 1.0),
    ("numerical", "1.0101", "1", 0.0),  # the edge is inclusive despite floats
    ("numerical", "0.504", "0.5", 1.0),
    ("numerical", "0.509", "0.5", 0.0),  # relative also for small values
    ("numerical", "0.01", "0.001", 0.0),
    ("numerical", "0.00101", "0.001", 1.0),
    ("numerical", "0.001", "0", 0.0),
    ("numerical", "3 or 4", "3", 0.0),
    ("numerical", "between 999 and 1001", "1000", 0.0),
    ("numerical", "99-101", "100", 0.0),
    ("numerical", "3, 4", "3", 0.0),
    ("numerical", "3 or three", "3", 1.0),
    ("numerical", "lots", "3", None),
    ("numerical", "1/0", "3", None),
    ("numerical", "1e999", "3", None),
    # counting: the same reading, exact
    ("counting", "3", None, 1.0),
    ("counting", "three", None, 1.0),
    ("counting", "There are 3 shapes.", None, 1.0),
    ("counting", "3.0", None, 1.0),
    ("counting", "forty two", "42", 1.0),
    ("counting", "4", None, 0.0),
    ("counting", "151", "150", 0.0),
    ("counting", "3 or 4", None, 0.0),
    ("counting", "three or four", None, 0.0),
    ("counting", "none", None, None),
    # MRA, VSI-Bench's rule: share of t in 0.50..0.95 with rel = |pred - gt| / gt <= 1 - t, where 1 - t is computed as
    # its code does, in floats: 0.5, .45, .4, .35, 0.30000000000000004, .25, 0.19999999999999996, 0.15000000000000002,
    # 0.10000000000000009, 0.050000000000000044
    ("regression", "100", None, 1.0),
    ("regression", "90", None, 0.9),
    ("regression", "110", None, 0.9),
    # an error exactly on the 10% threshold passes t = 0.90 (the case)
    (
        "regression",
        "11",
        "10",
        0.9,
    ),
    ("regression", "95", None, 1.0),
    ("regression", "70", None, 0.5),
    ("regression", "80", None, 0.6),
    ("regression", "60", None, 0.3),
    ("regression", "50", None, 0.1),
    ("regression", "300", None, 0.0),
    ("regression", "1.5 m", "2", 0.6),
    ("regression", "0", "0", 1.0),
    ("regression", "0.001", "0", 0.0),
    ("regression", "-90", "-100", 0.9),
    ("regression", "90 or 110", None, 0.0),
    ("regression", "about", None, None),
    # boolean: the committed word
    ("boolean", "yes", None, 1.0),
    ("boolean", "Yes, it is.", None, 1.0),
    ("boolean", "TRUE", None, 1.0),
    ("boolean", "It is true.", None, 1.0),
    ("boolean", "I think yes", None, 1.0),
    ("boolean", "Yes, but no other person does.", None, 1.0),
    ("boolean", "No", "no", 1.0),
    ("boolean", "no", "False", 1.0),
    ("boolean", "no", None, 0.0),
    ("boolean", "false", None, 0.0),
    ("boolean", "It is not true.", None, 0.0),
    ("boolean", "Yes and no", None, 0.0),
    ("boolean", "yes or no", None, 0.0),
    ("boolean", "yes/no", None, 0.0),
    ("boolean", "maybe", None, None),
    ("boolean", "Not sure", None, None),
    # open-ended: short ground truths by SQuAD (normalized EM, else token F1), long ones by rouge-score with stemming
    ("open-ended", "Red car.", "red car", 1.0),
    ("open-ended", "a red car", "red car", 1.0),  # articles dropped
    ("open-ended", "red", "red car", 2 / 3),  # P 1/1, R 1/2: F1 = 2 * 1 / (1 + 2)
    ("open-ended", "a blue car", "red car", 0.5),
    ("open-ended", "dog", "red car", 0.0),
    ("open-ended", "Ｒｅｄ car", "ｒｅｄ car", 1.0),  # unicode words
    ("open-ended", "the cat sat on the mat", None, ROUGE_EX),
    ("open-ended", "The cat is on the mat!", None, 1.0),
    ("open-ended", "The cats are on the mats", None, ROUGE_EX),  # Porter: cats -> cat, mats -> mat
    # the reference said three times: R1 = R-L = 2 * 6 / (18 + 6), R2 = 2 * 5 / (17 + 5) (clipped counts)
    ("open-ended", "the cat is on the mat " * 3, None, (0.5 + 10 / 22 + 0.5) / 3),
    ("open-ended", "dog", None, 0.0),
    ("ocr", "hello world foo bar", None, 1.0),
    ("ocr", "hello word foo", None, 0.5),  # 1 sub + 1 del of 4 words
    ("ocr", "Hello World Foo Bar", None, 1.0),
    ("ocr", "a b c d e f g h i j", None, 0.0),  # WER > 1 clips to 0
    ("ocr", "hello world foo bar baz", None, 0.75),
    ("ocr", "hello world foo bar " * 2, None, 0.0),  # 2x long: WER >= 1
    ("math", "0.5", None, 1.0),
    ("math", "\\frac{1}{2}", None, 1.0),
    ("math", "1/2", None, 1.0),
    ("math", "\\frac{2}{4}", None, 1.0),
    ("math", "3", None, 0.0),
    ("math", "x^2+", None, 0.0),
    ("math", "\\sqrt{2}", "2^{1/2}", 1.0),
    ("math", "x + x", "2x", 1.0),
    ("math", "50\\%", None, 1.0),
    # ~0.8 s of sympy on an idle machine (see test_accuracy_table)
    (
        "math",
        "\\sin^2 x + \\cos^2 x",
        "1",
        1.0,
    ),
    # temporal grounding: JSON (numbers as strings too; the last complete object), else a span in text
    ("temporal grounding", '{"time": [2, 6]}', None, 1.0),
    ("temporal grounding", '{"time": [4, 10]}', None, 0.25),  # inter 2 / union 8
    ("temporal grounding", 'The span is {"time": [4, 10]}.', None, 0.25),
    ("temporal grounding", "[4, 10]", None, 0.25),
    ("temporal grounding", '{"time": ["4", "10"]}', None, 0.25),
    ("temporal grounding", "from 4 to 10 seconds", None, 0.25),
    ("temporal grounding", "4s - 10s", None, 0.25),
    ("temporal grounding", "from 2 to 6", None, 1.0),
    # the last complete one
    (
        "temporal grounding",
        'No, {"time": [7, 9]}. Corrected: {"time": [2, 6]}',
        None,
        1.0,
    ),
    ("temporal grounding", '{"time": [2, 6]} {"time": [7,', None, 1.0),
    ("temporal grounding", '{"time": [7, 9]}', None, 0.0),
    ("temporal grounding", '{"time": [3, 3]}', None, 0.0),
    ("temporal grounding", '{"time": [3, 3]}', '{"time": [3, 3]}', 1.0),
    ('temporal grounding', '```json\n{"time": [2.0, 6.0]}\n```', None, 1.0),
    ("temporal grounding", '{"time": [6, 2]}', None, None),
    ("temporal grounding", '{"time": "2-6"}', None, None),
    ("temporal grounding", "at 4 seconds", None, None),
    # spatial grounding: JSON, a bare list, a tuple in text
    ("spatial grounding", '{"boxes": [0, 0, 10, 10]}', None, 1.0),
    ("spatial grounding", '{"boxes": [5, 5, 15, 15]}', None, 1 / 7),  # inter 25 / union 175
    ("spatial grounding", "[5, 5, 15, 15]", None, 1 / 7),
    ("spatial grounding", '{"boxes": [[5, 5, 15, 15]]}', None, 1 / 7),
    ("spatial grounding", "The box is (5, 5, 15, 15).", None, 1 / 7),
    ("spatial grounding", '{"boxes": ["5", "5", "15", "15"]}', None, 1 / 7),
    ("spatial grounding", '{"boxes": [20, 20, 30, 30]}', None, 0.0),
    ("spatial grounding", '{"boxes": [1, 2, 3]}', None, None),
    # x2 < x1 (an [x, y, w, h] box, say)
    (
        "spatial grounding",
        '{"boxes": [10, 10, 0, 0]}',
        None,
        None,
    ),
    # gt not in {"boxes": ..}: a data error
    (
        "spatial grounding",
        "[0, 0, 0, 10]",
        "[0, 0, 0, 10]",
        None,
    ),
    # equal empty boxes match
    (
        "spatial grounding",
        '{"boxes": [3, 3, 3, 3]}',
        '{"boxes": [3, 3, 3, 3]}',
        1.0,
    ),
    # spatial-temporal grounding: 0.5 * time IoU + 0.5 * mean box IoU over common seconds, partial credit throughout
    (ST, GT[ST], None, 1.0),
    # 0.5 * time IoU 2/4 + 0.5 * mean box IoU over common seconds (1 + 50/150) / 2
    (ST, '{"time": [0, 2], "boxes": {"0": [0, 0, 10, 10], "1": [5, 0, 15, 10]}}', None, 7 / 12),
    (ST, '{"time": [0, 4], "boxes": {"0.0": [0, 0, 10, 10]}}', None, 1.0),  # common: second 0
    (ST, '{"time": [0, 4], "boxes": {"7": [0, 0, 10, 10]}}', None, 0.5),  # no common second
    (ST, '{"time": [2, 6], "boxes": {"1": [0, 0, 5, 10]}}', None, 0.5 * 1 / 3 + 0.5 * 0.5),
    (ST, '{"time": [0, 4]}', None, 0.5),
    (ST, '{"time": [0, 2], "boxes": {}}', None, 0.25),  # no boxes: 0.5 * tIoU
    # a list names no seconds: no boxes
    (
        ST,
        '{"time": [0, 4], "boxes": [[0, 0, 10, 10]]}',
        None,
        0.5,
    ),
    # swapped: IoU 0
    (
        ST,
        '{"time": [0, 4], "boxes": {"0": [0, 0, 10, 10], "1": [10, 10, 0, 0]}}',
        None,
        0.75,
    ),
    # malformed: IoU 0
    (
        ST,
        '{"time": [0, 4], "boxes": {"0": [0, 0, 10, 10], "1": [0, 1]}}',
        None,
        0.75,
    ),
    # bad span: tIoU 0
    (
        ST,
        '{"time": [4, 0], "boxes": {"0": [0, 0, 10, 10], "1": [0, 0, 10, 10]}}',
        None,
        0.5,
    ),
    (ST, '{"boxes": {"0": [0, 0, 10, 10]}}', None, 0.5),
    (ST, '{"when": [0, 4]}', None, None),
    # tracking: mean IoU over the ground truth's 3 frames, a missing or malformed box counting 0
    ("tracking", GT["tracking"], None, 1.0),
    # (1 + 0 + 1/2) / 3: frame 1 missing
    ("tracking", '{"boxes": {"0": [0, 0, 10, 10], "2": [0, 0, 5, 10]}}', None, 0.5),
    (
        "tracking",
        '{"boxes": {"0": [0, 0, 10, 10], "1": [0, 0, 10, 10], "2": [0, 0, 10, 10], "9": [1, 1, 2, 2]}}',
        None,
        1.0,
    ),
    ("tracking", '{"boxes": {"5": [0, 0, 10, 10]}}', None, 0.0),  # no common frame
    ("tracking", '{"boxes": {"0": [0, 0, 10, 10], "1": [1, 2, 3]}}', None, 1 / 3),
    # one perfect frame of three is not a full score
    (
        "tracking",
        '{"boxes": {"1": [0, 0, 10, 10]}}',
        None,
        1 / 3,
    ),
    (
        "tracking",
        '{"boxes": {"0": [0, 0, 10, 10], "1": [10, 10, 0, 0], "2": [0, 0, 10, 10]}}',
        None,
        2 / 3,
    ),
    ("tracking", '{"boxes": {}}', None, None),
    # code: difflib ratio 2M / T of normalized token streams; 1 only for an equivalent program text
    ("code", PY_REF, PY_REF, 1.0),
    ("code", "def f(x):  # add one\n  return x+1", PY_REF, 1.0),  # format, comment
    ("code", "def g(y):\n    return y + 1", PY_REF, 1.0),
    ("code", f"```python\n{PY_REF}\n```", PY_REF, 1.0),
    ("code", "def f(x):\n    return x + 2", PY_REF, 0.9),  # 9 of 10 tokens: 2 * 9 / 20
    ("code", "print(2)", "print(1)", 0.75),  # print ( 2 ) vs print ( 1 ): 2 * 3 / 8
    # a free name is not renamed: builtins keep their meaning
    (
        "code",
        "print(len)",
        "print(x)",
        0.75,
    ),
    ("code", "pass", PY_REF, 0.0),
    ("code", "42", PY_REF, 0.0),
    ("code", "hello", PY_REF, 0.0),
    ("code", "N/A", PY_REF, 0.0),
    ("code", "def f(:\n  pass", PY_REF, 0.0),
    ("code", "print('unclosed", None, 0.0),
    ("svg-code", SVG_REF, SVG_REF, 1.0),
    ("svg-code", '<svg  width="10"><!-- c --><rect x="1"></rect></svg>', SVG_REF, 1.0),
    # attribute order
    (
        "svg-code",
        '<svg><rect y="2" x="1"/></svg>',
        '<svg><rect x="1" y="2"/></svg>',
        1.0,
    ),
    # <svg width=10 ... </svg: 2 * 3 / 12
    (
        "svg-code",
        '<svg width="10"><circle r="1"/></svg>',
        SVG_REF,
        0.5,
    ),
    ("svg-code", "hello", SVG_REF, 0.0),
    ("svg-code", "N/A", SVG_REF, 0.0),
    ("svg-code", BOMB, SVG_REF, 0.0),  # entities are never expanded
    # nor fetched
    (
        "svg-code",
        '<!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/passwd">]><s>&x;</s>',
        SVG_REF,
        0.0,
    ),
    ("html-code", HTML_REF, HTML_REF, 1.0),
    ("html-code", "<P>Hello   <B>world</B></P><!-- x -->", HTML_REF, 1.0),
    ("html-code", "<p>Hello world</p>", HTML_REF, 0.8),  # 4 tokens in order of 6 and 4: 2 * 4 / 10
    ("html-code", "pass", HTML_REF, 0.0),
]


@pytest.mark.parametrize("ptype, ans, gt, want", CASES)
def test_accuracy_table(ptype, ans, gt, want, monkeypatch):
    # the rules, not the time limit (tested below): a loaded machine stretched sympy's 0.8 s past 1 s of wall time
    monkeypatch.setattr(rewards, "MATH_TIMEOUT", 30.0)
    c = score(ptype, f"<answer>{ans}</answer>", answer=gt)
    # images: the same
    assert c == score(
        ptype, f"<answer>{ans}</answer>", answer=gt, data_type="image", images=["x.png"]
    )
    assert c["parse_fail"] == float(want is None)
    assert c["accuracy"] == pytest.approx(want or 0.0, abs=1e-9)
    assert c["format"] == 1.0


def test_rouge_and_wer_by_hand():
    assert rewards.rouge("the cat sat on the mat", "the cat is on the mat") == pytest.approx(
        ROUGE_EX
    )
    assert rewards.wer("hello word foo", "hello world foo bar") == 0.5
    assert rewards.wer("a", "") == 1.0 and rewards.wer("", "") == 0.0
    assert rewards.iou_1d([2, 6], [4, 10]) == 0.25 and rewards.iou_box(
        [0, 0, 10, 10], [5, 5, 15, 15]
    ) == pytest.approx(1 / 7)


def test_mra_exact_values():  # VSI-Bench: (|pred - gt| / gt <= 1 - np.linspace(0.5, 0.95, 10)).mean()
    assert [rewards.mra(p, 100) for p in (100, 90, 70, 95, 50)] == [1.0, 0.9, 0.5, 1.0, 0.1]
    # 0.1 passes 1 - 0.9; 0.2 fails 1 - 0.8 in floats
    assert rewards.mra(11, 10) == 0.9 and rewards.mra(80, 100) == 0.6


def test_math_boxed_without_answer_tags():
    assert score("math", "so it is \\boxed{0.5}")["accuracy"] == 1.0


SLOW_MATH = [
    "(" * 300,
    "{" * 300,
    "\\frac{" * 200,
]  # math-verify alone: 8 s, 9 s, 1.2 s of CPU (load 17)


# the power tower: a C-level big-int loop
@pytest.mark.parametrize("slow", SLOW_MATH + ["2^{2^{2^{2^{2^{99}}}}}"])
def test_math_time_limit_cleans_up(warm, slow):
    before = signal.getsignal(signal.SIGALRM)
    # CPU time (see PATHOLOGICAL below): the limit is wall-clock, so load only lowers it
    t0 = time.thread_time()
    assert score("math", f"<answer>{slow}</answer>")["accuracy"] == 0.0
    assert time.thread_time() - t0 < rewards.MATH_TIMEOUT + 0.4
    assert (
        signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        and signal.getsignal(signal.SIGALRM) is before
    )
    assert score("math", "<answer>0.5</answer>")["accuracy"] == 1.0  # and it still works afterwards
    time.sleep(0.12)  # no late alarm goes off


def test_math_time_limit_in_threads(warm):
    """Two scoring threads at once (SIGALRM is main-thread only: the watchdog path); no exception leaks out later."""
    out, errors, before = {}, [], threading.active_count()

    def work(i):
        try:
            t0 = time.thread_time()  # this thread's CPU time, as in test_math_time_limit_cleans_up
            out[i] = [score("math", f"<answer>{x}</answer>")["accuracy"] for x in SLOW_MATH]
            out[i].append(time.thread_time() - t0)
            out[i].append(score("math", "<answer>0.5</answer>")["accuracy"])
            time.sleep(0.15)  # a late MathTimeout would land here
            out[i].append(sum(range(10**5)))
        except BaseException as e:  # noqa: BLE001  recorded and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert not errors and len(out) == 2
    for acc0, acc1, acc2, dt, ok, total in out.values():
        assert (acc0, acc1, acc2, ok, total) == (0.0, 0.0, 0.0, 1.0, sum(range(10**5)))
        assert dt < 3 * (rewards.MATH_TIMEOUT + 0.4)
    time.sleep(0.1)
    assert threading.active_count() == before  # every watchdog has ended


def test_code_is_never_executed(tmp_path):
    flag = tmp_path / "pwned_x"
    payload = f"__import__('os').system('touch {flag}')\nopen({str(flag)!r}, 'w').write('x')"
    c = score("code", f"<answer>{payload}</answer>", answer=payload)
    assert c["accuracy"] == 1.0  # the reference itself...
    assert not flag.exists() and not os.path.exists("/tmp/pwned_x")  # ...and never run


# ---------------------------------------------------------------------------------------------------
# malformed model output: never raises, value in [0, 1], parse failures counted
MALFORMED = {
    "empty": ("", True),
    "spaces": ("   \n ", True),
    "1MB": ("x" * 1_000_000, True),
    "blank": ("<answer>\u200b\x00 </answer>", True),
    # cut at MAX_LEN: the tag never closes
    "1MB in tags": (
        "<answer>" + "7" * 1_000_000 + "</answer>",
        True,
    ),
    "unicode": ("<answer>ＢＢ 😀 ñ \u202e\u0000</answer>", None),
    "unclosed": ("<answer>B", True),
    "unclosed think": ("<think>B", True),
    "only close": ("B</answer>", True),
    "nested": ("<answer><answer>B</answer></answer>", False),
    "several": ("<answer>A</answer><answer>B</answer>", False),
    "NaN": ('<answer>{"time": [NaN, 5], "boxes": [0, 0, NaN, 1]}</answer>', None),
    "inf": ('<answer>{"time": [0, Infinity], "boxes": [0, 0, -Infinity, 1]}</answer>', None),
    "huge int": (
        '<answer>{"time": [0, 1'
        + "0" * 400
        + '], "boxes": [0, 0, 1'
        + "0" * 400
        + ", 1]}</answer>",
        None,
    ),
    "3-number box": ('<answer>{"time": [0, 1], "boxes": [0, 0, 1]}</answer>', None),
    "deep json": ("<answer>" + "[" * 5000 + "]" * 5000 + "</answer>", None),
    "bools": ('<answer>{"time": [true, false], "boxes": [true, false, true, true]}</answer>', None),
}


@pytest.mark.parametrize("ptype", TYPES)
@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed(ptype, name):
    text, fails = MALFORMED[name]
    overall, c = compute_reward(text, sample(ptype))
    assert 0.0 <= overall <= 1.0 and 0.0 <= c["accuracy"] <= 1.0 and c["parse_fail"] in (0.0, 1.0)
    if fails:
        assert c["parse_fail"] == 1.0 and c["accuracy"] == 0.0
    if fails is False and ptype == "multiple choice":
        assert c["accuracy"] == 1.0


@pytest.mark.parametrize(
    "ptype", ["temporal grounding", "spatial grounding", "spatial-temporal grounding", "tracking"]
)
@pytest.mark.parametrize("name", ["NaN", "inf", "huge int", "3-number box", "deep json", "bools"])
def test_malformed_json_is_a_parse_failure(ptype, name):
    if ptype in ("temporal grounding", ST) and name == "3-number box":
        pytest.skip(
            "its time span is well formed (and spatial-temporal grounding scores it 0.5 * tIoU)"
        )
    assert score(ptype, MALFORMED[name][0])["parse_fail"] == 1.0


# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "alias, want",
    [
        ("multiple_choice", "multiple choice"),
        ("free-form", "open-ended"),
        ("video qa", "open-ended"),
        ("MULTIPLE CHOICE ", "multiple choice"),
        ("  Video   QA", "open-ended"),
        ("mcq", "multiple choice"),
        ("count", "counting"),
        ("yes/no", "boolean"),
        ("temporal_grounding", "temporal grounding"),
        ("OCR", "ocr"),
        ("binary classification", "boolean"),
        ("number", "numerical"),
        ("open_ended", "open-ended"),
        ("mathematics", "math"),
        ("video description", "open-ended"),
        ("coding", "code"),
        ("SVG", "svg-code"),
        ("html", "html-code"),
        ("multiple-choice", "multiple choice"),
        ("multi-choice", "multiple choice"),
        ("REC", "counting"),
        ("SSR", "boolean"),
        ("CRR", "boolean"),
        ("caption", "open-ended"),
        ("captioning", "open-ended"),
        ("spatial_temporal_grounding", "spatial-temporal grounding"),
    ],
)
def test_aliases(alias, want):
    assert canonical_type(alias) == want
    s = sample(want, problem_type=alias)
    # routed to the right scorer
    assert compute_reward(f"<answer>{s['answer']}</answer>", s)[1]["accuracy"] == 1.0


def test_unknown_type_scored_open_ended():
    assert (
        compute_reward("<answer>red car</answer>", {"problem_type": "dance", "answer": "red car"})[
            0
        ]
        == 1.0
    )


@pytest.mark.parametrize(
    "template, text, want",
    [
        ("answer", "<answer>B</answer>", 1.0),
        ("answer", " \n<answer>B</answer>\n", 1.0),
        ("answer", "<answer>\nmulti\nline\n</answer>", 1.0),
        ("answer", "B", 0.0),
        ("answer", "", 0.0),
        ("answer", None, 0.0),
        ("answer", "<think>x</think><answer>B</answer>", 0.0),
        ("answer", "<answer>A</answer><answer>B</answer>", 0.0),
        ("answer", "<answer>B</answer></answer>", 0.0),
        ("answer", "<answer>B", 0.0),
        ("answer", "so <answer>B</answer>", 0.0),
        ("answer", "<answer>" + "x" * 6000 + "</answer>", 0.0),  # answers are short
        ("answer", "<answer></answer>", 0.0),
        ("answer", "<answer> \n</answer>", 0.0),
        ("answer", "<answer>\u200b</answer>", 0.0),
        ("answer", "<answer>\x00</answer>", 0.0),
        ("think_answer", "<think>x</think><answer>\ufeff </answer>", 0.0),
        ("think_answer", "<think>x</think>\n<answer>B</answer>", 1.0),
        ("think_answer", "<think>\n</think><answer>B</answer>", 1.0),
        ("think_answer", "<answer>B</answer>", 0.0),
        ("think_answer", "<think>x</think>", 0.0),
        ("think_answer", "<think><think>x</think></think><answer>B</answer>", 0.0),
        ("think_answer", "<think>x</think><answer>B</answer> more", 0.0),
        ("think_answer", "<think>x <answer>A</answer></think><answer>B</answer>", 0.0),
        ("think_answer", "<think>x</think><answer>B</answer><answer>C</answer>", 0.0),
    ],
)
def test_format_reward(template, text, want):
    assert format_reward(text, template) == want


def test_compute_reward_weighting_and_components():
    s = sample("multiple choice")
    assert compute_reward("<answer>B</answer>", s) == (
        1.0,
        {"overall": 1.0, "accuracy": 1.0, "format": 1.0, "parse_fail": 0.0},
    )
    overall, c = compute_reward("The answer is B", s)  # right, badly formatted
    assert overall == pytest.approx(0.9) and c == {
        "overall": overall,
        "accuracy": 1.0,
        "format": 0.0,
        "parse_fail": 0.0,
    }
    overall, c = compute_reward("<answer>A</answer>", s)  # wrong, well formatted
    assert overall == pytest.approx(0.1) and c["accuracy"] == 0.0 and c["parse_fail"] == 0.0
    overall, c = compute_reward("<answer>Z</answer>", s)  # unparseable
    assert overall == pytest.approx(0.1) and c["parse_fail"] == 1.0
    assert compute_reward("no idea", s)[0] == 0.0
    assert compute_reward("<answer>B</answer>", s, w_acc=0.5, w_fmt=0.5)[0] == 1.0
    assert compute_reward("The answer is B", s, w_acc=0.5, w_fmt=0.5)[0] == 0.5
    assert (
        compute_reward("<think>x</think><answer>B</answer>", s, format_template="think_answer")[1][
            "format"
        ]
        == 1.0
    )
    assert compute_reward("<think>x</think><answer>B</answer>", s)[1]["format"] == 0.0
    r = compute_reward('<answer>{"time": [4, 10]}</answer>', sample("temporal grounding"))[0]
    assert r == pytest.approx(0.9 * 0.25 + 0.1)


# ---------------------------------------------------------------------------------------------------
BAD_GT = [
    ("multiple choice", "E"),
    ("multiple choice", "dog"),
    ("multiple choice", ""),
    ("numerical", "many"),
    ("numerical", "1/0"),
    ("counting", ""),
    ("regression", "abc"),
    ("boolean", "maybe"),
    ("open-ended", ""),
    ("ocr", "  "),
    ("math", ""),
    ("temporal grounding", '{"time": [5, 2]}'),
    ("temporal grounding", '{"time": [1]}'),
    ("temporal grounding", "2 to 6"),
    ("temporal grounding", '{"time": [0, NaN]}'),
    ("spatial grounding", '{"boxes": [1, 2, 3]}'),
    ("spatial grounding", "[0, 0, 1, 1]"),
    ("spatial grounding", "{}"),
    ("spatial grounding", '{"boxes": [0, 0, 1e999, 1]}'),
    ("spatial grounding", '{"boxes": [10, 0, 0, 10]}'),
    ("spatial-temporal grounding", '{"time": [4, 0], "boxes": {"0": [0, 0, 1, 1]}}'),
    ("spatial-temporal grounding", '{"time": [0, 4]}'),
    ("spatial-temporal grounding", '{"time": [0, 4], "boxes": {"0": [0, 1]}}'),
    ("tracking", '{"boxes": {}}'),
    ("tracking", '{"boxes": {"0": [1, 2, 3]}}'),
    ("tracking", '{"boxes": [0, 0, 1, 1]}'),
    ("tracking", '{"boxes": {"0": [0, 0, 1' + "0" * 400 + ", 1]}}"),
    ("tracking", '{"boxes": {"0": [0, 5, 1, 1]}}'),
    ("dance", "x"),
    ("code", ""),
    ("code", "def f(:"),
    ("numerical", "3 or 4"),
    ("boolean", "yes or no"),
    ("multiple choice", "A or B"),
]


@pytest.mark.parametrize("ptype, gt", BAD_GT)
def test_validate_answer_rejects(ptype, gt):
    s = {"id": "bad-42", "problem_type": ptype, "answer": gt}
    if ptype == "multiple choice":
        s["options"] = OPTIONS
    with pytest.raises(ValueError, match="bad-42"):
        validate_answer(s)


@pytest.mark.parametrize(
    "ptype", TYPES + ["multiple_choice", "free-form", "video qa", "MULTIPLE CHOICE "]
)
def test_validate_answer_accepts(ptype):
    validate_answer(sample(ptype))
    validate_answer(sample(ptype, answer=f"<answer>{GT[canonical_type(ptype)]}</answer>"))


def test_validate_answer_more_good_ones():
    for ptype, gt in [
        ("multiple choice", "(B)"),
        ("multiple choice", "B. a dog is running"),
        ("numerical", "1/2"),
        ("boolean", "No"),
        ("code", "<svg/>"),
        ("tracking", '{"boxes": {"0": [0, 0, 1, 1]}}'),
    ]:
        validate_answer(sample(ptype, answer=gt))
    # no options: any letter
    validate_answer({"id": "x", "problem_type": "multiple choice", "answer": "F"})


# ---------------------------------------------------------------------------------------------------
# property: arbitrary strings never raise and always score in [0, 1], for every problem type
TOKENS = list("<>/answerthik{}[]()\\boxed0123456789.,:-\"% \n") + [
    "<answer>",
    "</answer>",
    "<think>",
    "</think>",
    "NaN",
    '{"time": [',
    '{"boxes": {"0": [',
    "\\boxed{",
    "answer is ",
]
# strings the parsers have to look at twice
TAGGY = st.lists(st.sampled_from(TOKENS), max_size=60).map("".join)


def check(text, ptype):
    check_sample(text, sample(ptype))


def check_sample(text, s):
    overall, c = compute_reward(text, s)
    assert 0.0 <= overall <= 1.0 and 0.0 <= c["accuracy"] <= 1.0
    assert c["format"] in (0.0, 1.0) and c["parse_fail"] in (0.0, 1.0)
    assert overall == pytest.approx(0.9 * c["accuracy"] + 0.1 * c["format"])


PROP = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("ptype", TYPES)
@PROP
@given(text=st.text())
def test_property_arbitrary_text(ptype, text):
    check(text, ptype)


@pytest.mark.parametrize("ptype", TYPES)
@PROP
@given(text=st.text() | TAGGY)
def test_property_wrapped_in_answer_tags(ptype, text):
    check(f"<answer>{text}</answer>", ptype)
    if "<" not in text:  # no tags inside: the content comes back as it is, stripped
        assert extract_answer(f"<answer>{text}</answer>") == (
            None if rewards.blank(text) else text.strip()
        )


# property: arbitrary valid samples of every type. The ground truth given back as the answer scores 1 and passes
# validate_answer; arbitrary text against it stays in [0, 1]; arbitrary (unvalidated) samples never raise either
NUM = st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: repr(round(x, 3)))
BOX = st.lists(st.integers(0, 1000), min_size=4, max_size=4).map(
    lambda b: [min(b[0], b[2]), min(b[1], b[3]), max(b[0], b[2]), max(b[1], b[3])]
)
SPAN = st.lists(st.floats(0, 1e4), min_size=2, max_size=2).map(sorted)
FRAMES = st.dictionaries(st.integers(0, 64).map(str), BOX, min_size=1, max_size=8)
WORDS_ST = st.lists(
    st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=8), min_size=1, max_size=30
).map(" ".join)
VALID_GT = {
    "multiple choice": st.sampled_from(["A", "B", "(C)", "D. blue", "a dog is running"]),
    "numerical": NUM,
    "counting": st.integers(0, 10**6).map(str),
    "regression": NUM,
    "boolean": st.sampled_from(["yes", "No", "TRUE", "false"]),
    "open-ended": WORDS_ST,
    "ocr": WORDS_ST,
    "math": st.tuples(st.integers(1, 99), st.integers(1, 99)).map(
        lambda f: f"\\frac{{{f[0]}}}{{{f[1]}}}"
    )
    | NUM,
    "temporal grounding": SPAN.map(lambda t: json.dumps({"time": t})),
    "spatial grounding": BOX.map(lambda b: json.dumps({"boxes": b})),
    "spatial-temporal grounding": st.tuples(SPAN, FRAMES).map(
        lambda x: json.dumps({"time": x[0], "boxes": x[1]})
    ),
    "tracking": FRAMES.map(lambda f: json.dumps({"boxes": f})),
    "code": st.sampled_from(["print(1)", "def f(x):\n    return x", "<svg><rect x='1'/></svg>"]),
    "svg-code": st.sampled_from(["<svg><rect x='1'/></svg>", "<svg/>"]),
    "html-code": WORDS_ST.map("<p>{}</p>".format),
}


def test_every_type_has_a_strategy():
    assert set(VALID_GT) == set(rewards.ACCURACY)


@pytest.mark.parametrize("ptype", TYPES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=st.text() | TAGGY)
def test_property_arbitrary_samples(ptype, data, text):
    s = sample(ptype, answer=data.draw(VALID_GT[ptype]))
    validate_answer(s)
    overall, c = compute_reward(f"<answer>{s['answer']}</answer>", s)
    assert c == {"overall": 1.0, "accuracy": 1.0, "format": 1.0, "parse_fail": 0.0}, s
    check_sample(text, s)
    check_sample(f"<answer>{text}</answer>", s)
    raw = {
        "problem_type": ptype,
        "answer": data.draw(st.text() | TAGGY | st.integers()),
        "options": data.draw(st.lists(st.text(), max_size=4) | st.none()),
    }
    check_sample(text, raw)
    check_sample(f"<answer>{text}</answer>", raw)


# ---------------------------------------------------------------------------------------------------
# bounded time: 200 KB of pathological input takes < MATH_TIMEOUT + 2 s of CPU per call for every type. CPU time of
# the scoring thread (time.thread_time), not wall time: other processes on a loaded machine stretch the wall clock,
# never this thread's CPU time, while a runaway parse or regex (minutes, or forever) burns CPU time all along
PATHOLOGICAL = {
    "answer tags": "<answer>" * 20000,
    "braces": "{" * 100000 + "}" * 100000,
    "open braces": "{" * 200000,
    "phrase": "answer is " * 20000,
    "think tags": "<think>" * 20000 + "</think>" * 5000,
    "boxed": "\\boxed{" * 20000,
    "in tags, brackets": "<answer>" + "[" * 200000 + "</answer>",
    "in tags, braces": "<answer>" + "{" * 100000 + "</answer>",
    "in tags, parens": "<answer>" + "(" * 200000 + "</answer>",
    "in tags, words": "<answer>" + "a b " * 50000 + "</answer>",
    "in tags, digits": "<answer>" + "1/" * 100000 + "</answer>",
    "in tags, commas": "<answer>1" + ",0" * 100000 + "</answer>",
    # within MAX_LEN, so that the answer reaches the parsers (math-verify takes seconds on these)
    "short parens": "<answer>" + "(" * 300 + "</answer>",
    "short braces": "<answer>" + "{" * 300 + "</answer>",
    "phrase in tags": "<answer>" + "answer is " * 50 + "</answer>",
    "15k braces": "<answer>" + "{" * 15000 + "</answer>",
    "15k brackets": "<answer>" + "[" * 15000 + "</answer>",
    "15k words": "<answer>" + "a " * 7000 + "</answer>",
    # html.parser takes seconds on the first and raises on the second (Python 3.11): markup_tokens uses neither
    "open comments": "<answer>" + "<!--" * 4900 + "</answer>",
    "marked sections": "<answer>" + "<![" * 6000 + "</answer>",
}


@pytest.fixture(scope="module")
def warm():
    # import math-verify and sympy once, outside the timing
    compute_reward("<answer>1</answer>", sample("math"))


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_bounded_time(warm, name):
    text = PATHOLOGICAL[name]
    for ptype in TYPES:
        t0 = time.thread_time()
        overall, _ = compute_reward(text, sample(ptype), format_template="think_answer")
        format_reward(text)
        dt = time.thread_time() - t0
        # a bound, not a speed target: catastrophic backtracking on these inputs takes minutes
        assert dt < rewards.MATH_TIMEOUT + 2.0, f"{ptype} on {name}: {dt:.2f} s of CPU"
        assert 0.0 <= overall <= 1.0 and math.isfinite(overall)


# property: a hedge between the truth and a wrong value scores 0 (an answer, not a parse failure) for every type with
# a single answer; relabelling the options together with the ground truth keeps the score
HEDGES = st.sampled_from(
    ["{} or {}", "{}, {}", "{} and {}", "between {} and {}", "either {} or maybe {}"]
)


@pytest.mark.parametrize(
    "ptype", ["multiple choice", "numerical", "counting", "regression", "boolean"]
)
@settings(max_examples=100, deadline=None)
@given(data=st.data(), form=HEDGES, truth_first=st.booleans())
def test_property_hedge_scores_zero(ptype, data, form, truth_first):
    if ptype == "multiple choice":
        truth, wrong = data.draw(st.permutations("ABCD"))[:2]
    elif ptype == "boolean":
        truth, wrong = data.draw(st.permutations(["yes", "no"]))
    else:
        value = data.draw(
            st.integers(0, 10**6)
            if ptype == "counting"
            else st.floats(-1e6, 1e6).map(lambda x: round(x, 3))
        )
        truth, wrong = (
            repr(value),
            repr(value + data.draw(st.sampled_from([1, -1, 2, 0.5])) * max(1, abs(value))),
        )
    pair = (truth, wrong) if truth_first else (wrong, truth)
    c = score(ptype, f"<answer>{form.format(*pair)}</answer>", answer=truth)
    assert c["accuracy"] == 0.0 and c["parse_fail"] == 0.0, form.format(*pair)


TEXTS = ["cat", "a dog is running", "red car", "blue", "green tree"]


@settings(max_examples=100, deadline=None)
@given(
    order=st.permutations(range(5)),
    truth=st.integers(0, 4),
    said=st.integers(0, 4),
    form=st.sampled_from(
        ["{L}", "({L})", "Option {L}", "The answer is {L}.", "{L}. {T}", "{T}", "**{L}**"]
    ),
)
def test_property_option_relabelling_keeps_the_score(order, truth, said, form):
    def run(perm):  # perm[k]: the text in position k; the letters follow the positions
        letter = {t: chr(65 + k) for k, t in enumerate(perm)}
        s = {
            "problem_type": "multiple choice",
            "options": [f"{letter[t]}. {TEXTS[t]}" for t in perm],
            "answer": letter[truth],
        }
        return compute_reward(f"<answer>{form.format(L=letter[said], T=TEXTS[said])}</answer>", s)[
            1
        ]

    assert (
        run(list(range(5)))
        == run(list(order))
        == {**run(list(order)), "accuracy": float(said == truth)}
    )


# ----------------------------------------------------------------------------------------------- the judge
def test_judge_verdict_rule():
    """The reply's last "Judgement: x", 0 <= x <= 1 (any case, spaces); else a parse failure."""
    assert rewards.verdict("Judgement: 1").score == 1.0
    assert rewards.verdict("judgement : 0.5\n").score == 0.5
    assert rewards.verdict("Judgement: 1 ... on reflection, Judgement: 0").score == 0.0
    for reply in ("", "Correct.", "Judgement: 7", "Judgement: yes", "x" * 10**6):
        v = rewards.verdict(reply)
        assert (v.score, v.error) == (None, "parse_fail"), reply[:20]


def test_judge_settings_and_an_unreachable_judge(tmp_path):
    """check_config's lines for bad judge settings; a closed port: every item a counted judge_error
    after 1 + judge_retries tries, the rule's accuracy kept, nothing cached, no exception."""
    bad = rewards.judge_problems(
        rewards.JudgeSettings(judge_url="localhost:8000", judge_template=str(tmp_path / "none"))
    )
    assert [b.split(" ")[0] for b in bad] == ["judge_url", "judge_url", "judge_template"]
    (tmp_path / "bad.jinja").write_text("{{ question ")
    bad = rewards.judge_problems(
        rewards.JudgeSettings(
            judge_url="http://x/v1", judge_model="m", judge_template=str(tmp_path / "bad.jinja")
        )
    )
    assert len(bad) == 1 and "TemplateSyntaxError" in bad[0]
    assert (
        rewards.judge_problems(rewards.JudgeSettings(judge_url="http://x/v1", judge_model="m"))
        == []
    )
    import socket

    with socket.socket() as s:  # bound, never listening: connection refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        judge = rewards.Judge(
            rewards.JudgeSettings(judge_url=url, judge_model="m", judge_retries=1),
            open("configs/judge.jinja").read(),
        )
        samples = [
            sample(t, a, problem="What is it?")
            for t, a in (("open-ended", "a red car"), ("mc", "A"))
        ]
        comps = rewards.judged_rewards(judge, ["<answer>a red car</answer>"] * 2, samples)
    assert [(c["judged"], c["judge_error"], c["accuracy"]) for c in comps] == [
        (1.0, 1.0, 1.0),  # the rule's score stays
        (0.0, 0.0, 0.0),  # not open-ended: the rule alone
    ]
    assert judge.counts["requests"] == 2 and judge.counts["judge_error"] == 1 and not judge.cache
    with pytest.raises(rewards.UserError, match="failed on 1 of 1 judged answers .*refused"):
        rewards.check_judge(comps, 0.2, "step 1", judge)

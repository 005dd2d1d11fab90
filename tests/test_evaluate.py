"""evaluate.py: each benchmark's official answer reading (table-driven, scores written from the official code's
behaviour), its official aggregation on hand-computed cases, every adapter on a fixture in its released format,
the loader's handling of broken records, and the real pipeline (AsyncLLM on the tiny checkpoint) against the plain
synchronous loop, resume, the HF fallback, two models in the default folder and the README's command as written."""

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from functools import partial

import pytest
from conftest import LIBRARY_NOISE, background, lane_result, quiet_lines, user_env

import data
import evaluate as E
from data import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "benchmarks")
NAMES = [b for b in E.load_adapters() if b != "nvr1"]
MC = {
    "id": "q",
    "options": ["A. red", "B. green", "C. blue", "D. yellow"],
    "answer": "B",
    "problem_type": "multiple choice",
}


@pytest.fixture(scope="module")
def videos(tmp_path_factory, synth):
    """Every video the fixtures name, as a copy of a synthetic video (cycling through the 4 colors)."""
    root, src = (
        tmp_path_factory.mktemp("videos"),
        data.load_samples(os.path.join(synth, "val.jsonl")),
    )
    srcs = [s["videos"][0] for s in src if s["id"].startswith("color")]
    cfg = E.Config(data_dir=FIXTURES, video_dir=str(root))
    for b in NAMES:
        for i, s in enumerate(E.load_benchmark(b, cfg, [])):
            os.makedirs(os.path.dirname(s["videos"][0]), exist_ok=True)
            shutil.copy(srcs[i % len(srcs)], s["videos"][0])
    return str(root)


# (benchmark, response, score) for a 4-option question whose answer is B, as each official function scores it (worked
# through its source, quirks included). None = nothing could be read (parse_fail; scored 0 or dropped by `drop`)
FORMS = {
    # Video-MME eval_your_results.py: its prefixes (two pairs joined by missing commas), then the first of [ABCD]
    "videomme": [
        ("B", 1),
        ("Answer: B", 0),
        ("Final Answer: B", 0),
        ("**B**", 1),
        ("Option B", 1),
        ("The answer is (B).", 1),
        ("Best answer: D", 1),
        ("C", 0),
        ("", None),
        ("A or B", 0),
        ("I cannot tell.", None),
        ("E", None),
    ],
    # Video-MME-v2 extract_characters_regex_v2: its longer prefix list, then the first option letter
    "videomme_v2": [
        ("B", 1),
        ("Answer: B", 1),
        ("Final Answer: B", 1),
        ("Option B", 1),
        ("Best option: (B)", 1),
        ("The answer is: C", 0),
        ("E", 0),
        ("", None),
    ],  # letters A-H, whatever the options
    # VSI-Bench: first space-separated token, trailing "." stripped, exact (case-insensitive)
    "vsibench": [
        ("B", 1),
        ("b.", 1),
        ("Answer: B", 0),
        ("**B**", 0),
        ("(B)", 0),
        ("The answer is (B).", 0),
        ("C", 0),
        ("", None),
        ("B or C", 1),
    ],
    # MVBench check_ans on the first line's first word (dots removed) inside "(b)" or holding it
    "mvbench": [
        ("B", 1),
        ("B\nbecause the screen is green", 1),
        ("B) green", 1),
        ("(B) green", 1),
        ("B. green", 1),
        ("Best option: (B) green", 1),
        ("Best option:(B)", 1),
        ("Answer: B", 0),
        ("**B**", 0),
        ("Option B", None),
        ("C", 0),
        ("", None),
    ],
    # LVBench / MotionBench polish_answer: cut at ")", after "(", first word's first character
    "lvbench": [
        ("B", 1),
        ("(B) green", 1),
        ("Best option: (B) green", 1),
        ("B. green", 1),
        ("Answer: B", 0),
        ("Option B", 0),
        ("C", 0),
        ("", None),
    ],
    "motionbench": [
        ("B", 1),
        ("(B) green", 1),
        ("B\nbecause", 1),
        ("Answer: B", 0),
        ("The answer is B", 0),
    ],
    # OVO-Bench: the right letter anywhere in the answer, case-sensitive
    "ovobench": [
        ("B", 1),
        ("Answer: B", 1),
        ("**B**", 1),
        ("A or B", 1),
        ("b", 0),
        ("C", 0),
        ("", None),
    ],
    # Video-MMMU parse_videommmu_multi_choice_response: "B."/"B:", "(B)", "B ", option text; never a guess
    "videommmu": [
        ("B", 1),
        ("Answer: B", 1),
        ("Final Answer: B", 1),
        ("Option B", 1),
        ("Best option: (B) x", 1),
        ("**B**", None),
        ("B or A", 0),
        ("A or B", 1),
        ("I think the screen is green all along", 1),
        ("A. red or B. green", 1),
        ("C: blue, not B", 0),
        ("The answer is B.", 1),
        ("", None),
    ],
    # EgoSchema / NExT-QA (lmms-eval's egoschema parse_multi_choice_response): "(B)", "B ", "B." all at once; several:
    # the first written ("get the first one", argmin); none: option text, else unreadable (or the random guess)
    "egoschema": [
        ("B", 1),
        ("Answer: B", 1),
        ("Option B", 1),
        ("**B**", None),
        ("B or A", 1),
        ("A or B", 0),
        ("B. green, not A", 1),
        ("I think the screen is green all along", 1),
        ("", None),
    ],
    # MLVU check_ans: before the first ")" exactly the letter (the "Best option:(" primer read past)
    "mlvu": [
        ("B", 1),
        ("B) green", 1),
        ("(B) green", 1),
        ("Best option: (B)", 1),
        ("B. green", None),
        ("Answer: B", None),
        ("C", 0),
        ("", None),
    ],
    # LongVideoBench (lmms-eval, the paper's code): 8 prefixes (not "Answer:"), then the first of the letters
    "longvideobench": [
        ("B", 1),
        ("The best answer is B", 1),
        ("Answer: B", 0),
        ("Option B", 1),
        ("E", 0),
        ("", None),
    ],
    # VideoMathQA (lmms-eval extract_characters_regex): Video-MME's prefixes, then the first of A-E
    "videomathqa": [
        ("B", 1),
        ("The answer is B", 1),
        ("Answer: B", 0),
        ("Best option: B", 1),
        ("E", 0),
        ("", None),
    ],
    # Perception Test / MMVU without a judge: the first option letter standing as a word
    "perceptiontest": [
        ("B", 1),
        ("Answer: B", 1),
        ("**B**", 1),
        ("Option B", 1),
        ("(B)", 1),
        ("A or B", 0),
        ("", None),
    ],
    # MINERVA: "answer is X" / "option: X", else the last letter
    "minerva": [
        ("B", 1),
        ("Answer: B", 1),
        ("Final Answer: B", 1),
        ("Option B", 1),
        ("B, not A", 0),
        ("The answer is B, not A", 1),
        ("", None),
    ],
}


@pytest.mark.parametrize("bench", FORMS)
def test_official_letter_forms(bench):
    s = dict(MC, ovo_task="EPM") if bench == "ovobench" else MC
    got = [(r, E.score(r, s, E.adapter(bench))[1]) for r, _ in FORMS[bench]]
    assert got == [(r, None if v is None else float(v)) for r, v in FORMS[bench]]
    # our format first
    assert E.score("<think>A?</think><answer>B</answer>", s, E.adapter(bench))[1] == 1.0
    # the tag decides
    assert E.score("<think>B?</think><answer>C</answer>", s, E.adapter(bench))[1] == 0.0


def test_official_number_span_and_yes_no_rules():
    vsi = dict(MC, problem_type="regression", options=[], answer="4")
    # VSI-Bench: float() of the first token, then MRA (|4.48 - 4| / 4 = 0.12 passes 8 of the 10 thresholds)
    assert [
        E.score(r, vsi, E.adapter("vsibench"))[1]
        for r in ("4", "4.", "4.48", "4%", "1,250", "four", "")
    ] == [1.0, 1.0, pytest.approx(0.8), None, None, None, None]
    mmmu = dict(vsi, problem_type="numerical", answer="3")
    # MMMU: "3%" holds the number 3; values compare rounded to 2 decimals; "1,250" is one number
    assert [
        E.score(r, mmmu, E.adapter("videommmu"))[1]
        for r in ("3%", "The answer is 3.001", "3.01", "4")
    ] == [1.0, 1.0, 0.0, 0.0]
    assert (
        E.score("so the total is 1,250", dict(mmmu, answer="1250"), E.adapter("videommmu"))[1]
        == 1.0
    )
    assert E.score("3.14", dict(mmmu, answer="3.14159"), E.adapter("videommmu"))[1] == 1.0
    ch = dict(vsi, problem_type="temporal grounding", answer='{"time": [12, 26]}')
    forms = (
        "00:12 - 00:26",
        "from 00:12 to 00:26",
        "12.0 - 26.0 seconds",
        '<answer>{"time": [12, 19]}</answer>',
        "00:00:12 to 00:00:19",
        "no idea",
    )
    assert [E.score(r, ch, E.adapter("charades_sta"))[1] for r in forms] == [
        1.0,
        1.0,
        1.0,
        0.5,
        0.5,
        None,
    ]
    # bounded time at the length cap
    for bad in (
        "1" * 20000,
        "1 " * 10000,
        "1." * 10000,
        ":1" * 10000,
    ):
        t = time.perf_counter()
        E.score(bad, ch, E.adapter("charades_sta"))
        # the span regex (~3 ms here): 11-14 s on a 20,000-digit run before
        assert time.perf_counter() - t < 0.5
        t = time.perf_counter()
        E.score(bad, mmmu, E.adapter("videommmu"))
        assert time.perf_counter() - t < 0.5  # MMMU's number patterns, length-bounded: linear
    ovo = dict(vsi, problem_type="boolean", answer="yes", ovo_task="SSR")
    assert [E.score(r, ovo, E.adapter("ovobench"))[1] for r in ("Y", "Yes.", "yes", "N", "No")] == [
        1,
        1,
        0,
        0,
        0,
    ]
    rec = dict(vsi, problem_type="counting", answer="12", ovo_task="REC")
    assert [
        E.score(r, rec, E.adapter("ovobench"))[1] for r in ("12", "1 then 2", "12 or 13", "")
    ] == [1, 1, 0, None]


def test_empty_answers_and_random_fallback():
    # MVBench: an empty answer is wrong and stays in the denominator (officially it is right: a documented
    # deviation); LongVideoBench guesses when asked; Video-MME leaves unreadable answers out of its denominator
    row = E.record(MC, "mvbench", "p", "")
    assert (row["score"], row["parse_fail"]) == (0.0, True)
    assert E.aggregate([row, E.record(MC, "mvbench", "p", "B")], "mvbench")["accuracy"] == 50
    ad = E.adapter("longvideobench")
    assert E.score("", MC, ad) == (None, None)
    picks = {E.score("", dict(MC, id=str(i)), ad, guess_seed=0)[0] for i in range(40)}
    assert picks == set("ABCD") and E.score("", MC, ad, guess_seed=0) == E.score(
        "", MC, ad, guess_seed=0
    )
    # Video-MME never guesses
    assert E.score("", MC, E.adapter("videomme"), guess_seed=0) == (
        None,
        None,
    )
    rows = [
        E.record(MC, "videomme", "p", r) for r in ("B", "I cannot tell.", "C")
    ]  # unreadable: not "answered"
    m = E.aggregate(rows, "videomme")
    assert (m["accuracy"], m["n"], m["dropped"], m["parse_fail"]) == (50, 3, 1, 1)
    # unfinished: our step reads nothing, the official rule reads A: counted
    cut = E.record(MC, "videomme", "p", "<think>The answer is A, or")
    assert (cut["score"], cut["parse_fail"], cut["dropped"]) == (
        0.0,
        True,
        False,
    )


HOLMES = dict(MC, options=[f"{c}. reason {c}" for c in "ABCDEF"], answer="E")
# (benchmark, sample, response, score): the rules that read more than a letter, from the official functions
RULES = [
    # Video-Holmes evaluate.py: last <answer>, then in letter order "X "/"X:"/"[X", then "X" anywhere
    ("holmes", HOLMES, "E", 1),
    ("holmes", HOLMES, "<think>hmm</think><answer>E: reason E</answer>", 1),
    ("holmes", HOLMES, "The answer is E", 1),
    ("holmes", HOLMES, "A man did E", 0),
    ("holmes", HOLMES, "[E]", 1),
    ("holmes", HOLMES, "", None),
]


@pytest.mark.parametrize("bench, s, response, want", RULES)
def test_official_rules(bench, s, response, want):
    assert E.score(response, s, E.adapter(bench))[1] == (None if want is None else float(want))


def tempcompass_samples() -> dict:
    cfg = E.Config(data_dir=FIXTURES, video_dir="/v")
    return {s["id"].split(":")[1]: s for s in E.load_benchmark("tempcompass", cfg, [])}


def test_tempcompass_official_rules():
    tc, ad = tempcompass_samples(), E.adapter("tempcompass")
    mc, yn = tc["tc0/attribute_change/1"], tc["tc1/speed/1"]  # answer "C. blue"; "no"
    # "Option 2: ..."; "Caption B: ..."
    option, caption = (
        tc["tc4/direction/1"],
        tc["tc3/attribute_change/1"],
    )
    table = [  # eval_multi-choice.py: the answer line, a bare letter, "C." or "C)" first; else (no judge) unreadable
        (mc, "C", 1),
        (mc, "C. blue", 1),
        (mc, "C) blue", 1),
        (mc, "C.", 1),
        (mc, "B", 0),
        (mc, "blue", None),
        (mc, "The answer is C", None),
        (mc, "c", None),
        (mc, " C\n", 1),  # each eval_*.py strips the response and drops "</s>" first
        (mc, "C</s>", 1),
        (mc, "\nC. blue\n", 1),
        # eval_yes_no.py: the first word, any case ("Not sure" starts with "no", as officially)
        (yn, "No.", 1),
        (yn, "yes", 0),
        (yn, "Not sure", 1),
        (yn, "I think no", None),
        (yn, "  no\n", 1),
        (yn, "\nYes", 0),
        # eval_caption_matching.py eval_rule: the option line, its sentence (also after "x) "), its label
        (option, "Option 2: The screen is yellow.", 1),
        (option, "The screen is yellow.", 1),
        (option, "Option 2", 1),
        (option, "Option 2.", 1),
        (option, "(b) The screen is yellow.", 1),
        (option, "Option 1", 0),
        # its option_inds also holds each label without "Sentence "/"Option "/"Caption ": a bare "2" or "B"
        (option, "2", 1),
        (option, "1", 0),
        (option, "B", None),
        (caption, "Caption B", 1),
        (caption, "B", 1),
        (caption, " B\n", 1),
        (caption, "The screen stays red.", 0),
    ]
    assert [(s["id"], r, E.score(r, s, ad)[1]) for s, r, _ in table] == [
        (s["id"], r, None if v is None else float(v)) for s, r, v in table
    ]


def test_videommmu_open_answers_and_empty_left_out():
    s, ad = dict(MC, problem_type="open-ended", options=[], answer="5"), E.adapter("videommmu")
    # the 26 key words: "are " makes "there and 3 were eaten" the key text, whose only number is 3
    assert [
        E.score(r, s, ad)[1]
        for r in (
            "5",
            "There are 5 squares",
            "5 apples are there and 3 were eaten",
            "so the total is 5.0",
            "",
        )
    ] == [1.0, 1.0, 0.0, 1.0, None]
    rows = [
        E.record(MC, "videommmu", "p", r) for r in ("B", "", "**B**")
    ]  # right, empty, unreadable
    assert [r["dropped"] for r in rows] == [False, True, False]
    assert not E.record(MC, "videommmu", "p", "<think>B or")[
        "dropped"
    ]  # cut off while thinking: wrong, counted
    # the empty answer leaves the denominator, the unreadable one stays (wrong)
    m = E.aggregate(rows, "videommmu")
    assert (m["accuracy"], m["n"], m["dropped"], m["parse_fail"]) == (50, 3, 1, 2)
    assert E.score("", MC, ad, guess_seed=0) == (None, None)  # never a guess


def test_mmvu_judges_multiple_choice_too():
    mm = E.load_benchmark("mmvu", E.Config(data_dir=FIXTURES, video_dir="/v"), [])
    rows = [E.record(s, "mmvu", "p", r) for s, r in zip(mm, ("A", "hydrogen"))]
    assert [r.get("judge") for r in rows] == [
        "none",
        "none",
    ]  # both go to --judge-model (GPT-4o officially)
    assert [r["score"] for r in rows] == [
        1.0,
        1.0,
    ]  # without a judge: the letter rule, the rule-based fallback
    assert E.judge_rows(rows, E.Config(), E.adapter("mmvu")["judge"]).startswith("none: ")


def test_answer_extraction_official():
    ad = E.adapter("videomme")
    assert E.score("<think>D?</think><answer>B</answer>", MC, ad)[1] == 1.0  # tags: ours first
    # official: the reader on the raw response, as a third-party model's leaderboard entry is scored
    assert E.score("<think>D?</think><answer>B</answer>", MC, ad, extraction="official")[1] == 0.0
    assert (
        E.record(MC, "videomme", "p", "<think>D?</think><answer>B</answer>", extraction="official")[
            "score"
        ]
        == 0
    )
    # a resume log of the other mode is refused
    assert "answers" in E.Config.__dataclass_fields__["answer_extraction"].metadata


# Each benchmark's own scorer, re-typed from its source for the shapes where the official mode differed (issue 47):
# the official mode must agree with it response by response.
def mvbench_official(response: str, gt: str) -> bool:
    """OpenGVLab/Ask-Anything video_chat2/mvbench.ipynb: infer_mvbench's return, then check_ans."""
    pred = "(" + response.strip().split("\n")[0]  # return_prompt + the first line
    pred_option = pred.lower().split(" ")[0]
    gt_option = gt.lower().split(" ")[0]
    return pred_option.replace(".", "") in gt_option or gt_option in pred_option


def videomathqa_official(s: str) -> str:
    """lmms-eval tasks/videomathqa/utils.py extract_characters_regex (its prefixes as the source
    joins them)."""
    s = s.strip()
    for p in ("The best answer is", "The correct answer is", "The answer is", "The answer",
              "The best option isThe correct option is", "Best answer:Best option:"):  # fmt: skip
        s = s.replace(p, "")
    if len(s.split()) > 10 and not re.search("[ABCDE]", s):
        return ""
    m = re.search(r"[ABCDE]", s)
    return m[0] if m else ""


def worldsense_official(response: str, options: list[str]) -> str:
    """lmms-eval tasks/worldsense/utils.py parse_multi_choice_response (numpy's argmax: the first
    largest)."""
    choices = "ABCD"[: min(len(options), 4)]
    index2ans = {c: options[i][3:] for i, c in enumerate(choices)}
    for char in [",", ".", "!", "?", ";", ":", "'"]:
        response = response.strip(char)
    response = " " + response + " "
    index_ans, ans_with_brack, candidates = True, False, []
    for choice in choices:
        if f"{choice}" in response:
            candidates.append(choice)
            ans_with_brack = True
    if len(candidates) == 0:
        for choice in choices:
            if f" {choice} " in response:
                candidates.append(choice)
    if len(candidates) == 0 and len(response.split()) > 5:
        for index, ans in index2ans.items():
            if ans.lower() in response.lower():
                candidates.append(index)
                index_ans = False
    if len(candidates) == 0:
        return "A"
    if len(candidates) == 1:
        return candidates[0]
    if index_ans and ans_with_brack:
        starts = [response.rfind(f"({can})") for can in candidates]
    elif index_ans:
        starts = [response.rfind(f" {can} ") for can in candidates]
    else:
        starts = [response.lower().rfind(index2ans[can].lower()) for can in candidates]
    return candidates[starts.index(max(starts))]


def tempcompass_mc_official(prediction: str, answer: str) -> int:
    """llyx97/TempCompass eval_multi-choice.py, --disable_llm."""
    prediction = prediction.replace("</s>", "").strip()
    if prediction == answer:
        return 1
    if prediction in ["A", "B", "C", "D"]:
        return int(prediction == answer[0])
    if any(prediction.startswith(p) for p in ["A.", "B.", "C.", "D."]):
        return int(prediction.split(".")[0] == answer[0])
    if any(prediction.startswith(p) for p in ["A)", "B)", "C)", "D)"]):
        return int(prediction.split(")")[0] == answer[0])
    return 0


def tempcompass_yes_no_official(prediction: str, answer: str) -> int:
    """llyx97/TempCompass eval_yes_no.py extract_pred, --disable_llm."""
    prediction = prediction.replace("</s>", "").strip().lower()
    pred = next((w for w in ("yes", "no") if prediction.startswith(w)), False)
    return int(bool(pred) and pred == answer)


OFFICIAL_SHAPES = [
    "B", "(B) green", "B) green", "B. green", "Best option: (B) green", "Best option:(B)",
    "Best option: B", "The answer is B", "Answer: B", "  B\n", "\n\nB\n\n", " B.\n", "\tB ",
    "\n(B)\n", "B\nC", "C", "A or B", "B, not A", "(A) no, (B)", "**B**", "b", "", "  ", "\n",
    "I think the screen is green all along", "It is green, not red at all here", "E",
    "The correct answer is: B", "Best answer: B", "Option B", "B</s>", "yes", "No.",
]  # fmt: skip


def test_official_mode_agrees_with_each_official_scorer():
    official = "official"
    mv, ws, vm = E.adapter("mvbench"), E.adapter("worldsense"), E.adapter("videomathqa")
    five = dict(MC, options=[*MC["options"], "E. white"])
    for r in OFFICIAL_SHAPES:
        want = float(mvbench_official(r, "(B) green"))
        assert E.score(r, MC, mv, extraction=official)[1] == want, r
        want = float(videomathqa_official(r) == "B")
        assert (E.score(r, five, vm, extraction=official)[1] or 0.0) == want, r
        for opts in (MC["options"], MC["options"][:3]):
            s = dict(MC, options=opts)
            want = float(worldsense_official(r, opts) == "B")
            assert E.score(r, s, ws, extraction=official)[1] == want, (r, len(opts))
    # the strict cases, by name: MVBench's echoed primer is wrong, its empty answer right
    assert E.score("Best option: (B) green", MC, mv, extraction=official)[1] == 0.0
    assert E.score("", MC, mv, extraction=official)[1] == 1.0
    assert E.score("Best option: (B) green", MC, mv)[1] == 1.0  # tags mode: lenient, documented
    # WorldSense: several letters and no "(X)": the first in letter order; nothing: "A"
    assert E.score("B, not A", MC, ws, extraction=official)[0] == "A"
    assert E.score("\n", dict(MC, answer="A"), ws, extraction=official) == ("A", 1.0)
    tc, ad = tempcompass_samples(), E.adapter("tempcompass")
    mc, yn = tc["tc0/attribute_change/1"], tc["tc1/speed/1"]  # answer "C. blue"; "no"
    for r in [*OFFICIAL_SHAPES, "C", " C. blue\n", "C)\n", "\tno", "  Yes.", "No</s>"]:
        want = tempcompass_mc_official(r, "C. blue")
        assert (E.score(r, mc, ad, extraction=official)[1] or 0.0) == want, r
        want = tempcompass_yes_no_official(r, "no")
        assert (E.score(r, yn, ad, extraction=official)[1] or 0.0) == want, r


def right(s, ad) -> str:
    """A correct response in the form the benchmark's prompt asks for."""
    gt, t = E.rewards.ground_truth(s), E.rewards.canonical_type(s["problem_type"])
    if s.get("format") == "caption_matching":  # TempCompass reads the option's label, not a letter
        return s["problem"].split("\n")[1 + ord(E.gt_letter(s)) - 65].split(": ")[0]
    return {
        "multiple choice": E.gt_letter(s),
        "boolean": gt.capitalize() + ".",
        "temporal grounding": f"<answer>{gt}</answer>",
        "open-ended": f"Final Answer: {gt}" if ad.get("after") else gt,
    }.get(t, gt)


@pytest.mark.parametrize("name", NAMES)
def test_adapter(name, videos):
    ad, skipped = E.adapter(name), []
    samples = E.load_benchmark(name, E.Config(data_dir=FIXTURES, video_dir=videos), skipped)
    assert samples and all(os.path.exists(s["videos"][0]) for s in samples)
    assert len({s["id"] for s in samples}) == len(samples)
    for s in samples:
        text = data.render_prompt(s, E.adapter(name).get("prompt"))
        assert s["problem"].split("\n")[0] in text
        # every option's text reaches the prompt
        assert all(o.split(" ", 1)[-1] in text for o in s["options"])
        parsed, v = E.score(right(s, ad), s, ad)
        assert v == 1.0 and parsed is not None, (s["id"], right(s, ad), parsed)
        if s["problem_type"] == "multiple choice":
            wrong = next(lt for lt in E.letters_of(s) if lt != E.gt_letter(s))
            # TempCompass caption matching cannot read a bare letter
            assert E.score(wrong, s, ad)[1] in (
                0.0,
                None,
            )
        row = E.record(s, name, "prompt", "I cannot tell.")
        assert (
            row["score"] == 0.0
            and row["doc_id"] == s["id"]
            and {"input", "target", "resps"} <= set(row)
        )
    rows = [E.record(s, name, "p", right(s, ad)) for s in samples] + [
        E.record(samples[0], name, "", "", "VideoError")
    ]
    metrics = E.aggregate(rows, name)  # a failed sample is counted, never scored
    assert metrics["accuracy"] == 100.0 and (metrics["n"], metrics["failed"]) == (len(samples), 1)
    assert all(f"{k}/" in " ".join(metrics) for k in ad.get("keys", ()))  # breakdowns are reported


def test_released_record_shapes():
    cfg = E.Config(data_dir=FIXTURES, video_dir="/v")
    skipped = []
    ego = E.load_benchmark("egoschema", cfg, skipped)
    assert [s["answer"] for s in ego] == ["D"] and [x["where"][-2:] for x in skipped] == [
        ":2"
    ]  # "3"; hidden
    assert [s["answer"] for s in E.load_benchmark("perceptiontest", cfg, [])] == [
        "A",
        "C",
    ]  # answer_id "0", "2"
    tc = {
        s["id"]: s for s in E.load_benchmark("tempcompass", cfg, [])
    }  # {video_id: {dim: [records]}}
    cm = [s for i, s in tc.items() if i.startswith("caption_matching")]
    assert [(s["answer"], s["options"][1], s["dim"]) for s in cm] == [
        ("B", "B. The screen stays green.", "attribute_change"),
        ("A", "B. The screen is yellow.", "speed"),
        ("B", "B. The screen is yellow.", "direction"),
    ]
    assert E.score("Caption B: The screen stays green.", cm[0], E.adapter("tempcompass"))[1] == 1.0
    # the Hugging Face parquet: its videoID wins over its url's id
    vm = E.load_benchmark("videomme", cfg, [])
    assert [s["videos"][0] for s in vm] == [f"/v/videomme/vid{i}.mp4" for i in range(3)]
    mm = {s["id"]: s for s in E.load_benchmark("videommmu", cfg, [])}  # {track: {index: record}}
    assert [(i, s["track"], s["discipline"], s["problem_type"]) for i, s in sorted(mm.items())] == [
        ("validation_Art_1", "Perception", "Art", "multiple choice"),
        ("validation_Math_3", "Adaptation", "Math", "open-ended"),
    ]
    # val.csv: where = the csv line; a quoted comma stays in its option
    nq = E.load_benchmark("nextqa", cfg, [])
    assert [(s["id"], s["answer"], s["options"][0], s["where"][-5:]) for s in nq] == [
        ("4010069381_1", "C", "A. to catch", "csv:2"),
        ("4010069381_2", "A", "A. running, fast", "csv:3"),
    ]
    assert nq[0]["videos"][0] == "/v/nextqa/4010069381.mp4"
    # charades_sta_test.txt: "vid start end##caption"
    ch = E.load_benchmark("charades_sta", cfg, [])
    assert [(s["answer"], s["videos"][0]) for s in ch] == [
        ('{"time": [0.0, 1.2]}', "/v/charades_sta/AO8RW.mp4"),
        ('{"time": [0.5, 2.0]}', "/v/charades_sta/3MSZA.mp4"),
    ]
    ml = E.load_benchmark("mlvu", cfg, [])  # json/<task>.json, the answer's text among candidates
    assert [(s["answer"], s["question_type"], s["videos"][0]) for s in ml] == [
        ("A", "plotQA", "/v/mlvu/1_plotQA/ml0.mp4"),
        ("B", "plotQA", "/v/mlvu/1_plotQA/ml1.mp4"),
        ("C", "count", "/v/mlvu/4_count/ml2.mp4"),
        # the generation tasks (no candidates): open-ended; sub-scene captioning's judge reads its points
        ("['The screen is blue', 'It stays blue']", "subPlot", "/v/mlvu/8_sub_scene/ml3.mp4"),
        ("A yellow screen that does not change.", "summary", "/v/mlvu/9_summary/ml4.mp4"),
    ]
    assert [s["problem_type"] for s in ml] == ["multiple choice"] * 3 + ["open-ended"] * 2
    # validation.json: video is the hub URL, open-ended choices are ""
    mv = E.load_benchmark("mmvu", cfg, [])
    assert [(s["subject"], s["problem_type"], s["options"][:1]) for s in mv] == [
        ("Chemistry", "multiple choice", ["A. red"]),
        ("Chemistry", "open-ended", []),
    ]
    lv = E.load_benchmark("longvideobench", cfg, [])  # lvb_val.json: candidates, correct_choice
    assert [(s["answer"], len(s["options"])) for s in lv] == [("C", 4), ("E", 5)]


def test_videomme_official_json_and_parquet_layouts(tmp_path):
    """The official JSON (one record per video, questions with choices) reads like the Hugging Face parquet."""
    video = {
        "video_id": "001",
        "duration_category": "short",
        "video_category": "Knowledge",
        "video_sub_category": "Humanity & History",
        "url": "https://www.youtube.com/watch?v=fFjv93ACGo8",
        "questions": [
            {
                "question_id": "001-1",
                "task_type": "Counting Problem",
                "question": "How many?",
                "choices": ["A. 1.", "B. 2.", "C. 3.", "D. 4."],
                "answer": "C",
            }
        ],
    }
    (tmp_path / "videomme.json").write_text(json.dumps([video]))
    (s,) = E.load_benchmark("videomme", E.Config(data_dir=str(tmp_path), video_dir="/v"), [])
    assert (s["id"], s["answer"], s["duration"], s["domain"], s["videos"][0]) == (
        "001-1",
        "C",
        "short",
        "Knowledge",
        "/v/videomme/fFjv93ACGo8.mp4",
    )


def test_unreadable_folders_and_fields_are_named(tmp_path):
    cfg = E.Config(data_dir=str(tmp_path), video_dir="/v")
    (tmp_path / "mlvu").mkdir()
    (tmp_path / "mlvu" / "README.md").write_text("x")
    with pytest.raises(
        FileNotFoundError,
        match=r"mlvu: no annotation file \(.jsonl, .json, .parquet, .csv, .txt\) .*"
        r"in the folder .*mlvu",
    ):
        E.load_benchmark("mlvu", cfg, [])
    # nested, but mlvu reads lists
    (tmp_path / "mlvu" / "1_plotQA.json").write_text(json.dumps({"v": {"q": [1]}}))
    with pytest.raises(
        DataError,
        match=r"mlvu: 0 samples .*1_plotQA.json: DataError: expected a JSON array of "
        r"records, got dict \(a nested release",
    ):
        E.load_benchmark("mlvu", cfg, [])
    (tmp_path / "mlvu" / "1_plotQA.json").write_text(
        json.dumps([{"video": "a.mp4", "question": "q?", "answer": "red"}])
    )
    with pytest.raises(DataError, match=r"1_plotQA.json:1: missing field 'candidates'"):
        E.load_benchmark("mlvu", cfg, [])
    (tmp_path / "longvideobench.json").write_text(
        json.dumps([{"question": "q?", "correct_choice": 0}])
    )
    with pytest.raises(DataError, match=r"longvideobench.json:1: missing field 'candidates'"):
        E.load_benchmark("longvideobench", cfg, [])
    (tmp_path / "mvbench.txt").write_text("a line\n")  # a format the benchmark does not read
    with pytest.raises(DataError, match=r"mvbench.txt: DataError: this benchmark reads no .txt"):
        E.load_benchmark("mvbench", cfg, [])
    (tmp_path / "charades_sta.txt").write_text("AO8RW 0.0 1.2##ok\nbroken line\n")
    bad = []
    assert len(E.load_benchmark("charades_sta", cfg, [], bad)) == 1
    assert bad[0]["where"].endswith("charades_sta.txt:2") and "does not match" in bad[0]["error"]
    # the release's questions.json, not joined with its answers: loud, not n = 0
    (tmp_path / "egoschema").mkdir()
    (tmp_path / "egoschema" / "questions.json").write_text(
        json.dumps([{"q_uid": "e0", "question": "q?"}])
    )
    with pytest.raises(
        DataError,
        match=r"egoschema: 0 samples .*questions.json:1: missing field 'answer'.*"
        r"preparation step",
    ):
        E.load_benchmark("egoschema", cfg, [])


def test_duplicate_ids_before_max_samples(tmp_path, capsys):
    cfg = E.Config(data_dir=FIXTURES, video_dir="/v", max_samples=1)
    # the repeat is the file's 3rd record: seen all the same
    (first,) = E.load_benchmark("livesports3k_qa", cfg, [])
    assert first["id"] == "0@livesports3k_qa.json:1"
    assert (
        "2 samples share their id with another, now unique: "
        f"{FIXTURES}/livesports3k_qa.json:1 -> 0@livesports3k_qa.json:1, "
        in capsys.readouterr().err
    )
    ids = [s["id"] for s in E.load_benchmark("livesports3k_qa", replace(cfg, max_samples=0), [])]
    assert ids == ["0@livesports3k_qa.json:1", "1", "0@livesports3k_qa.json:3"]
    # Video-MMMU repeats its ids across its 3 tracks: 300 repeats are one line, not 300
    os.makedirs(tmp_path / "many" / "videommmu")
    track = {str(i): {"id": f"validation_Art_{i}", "question": "q?", "options": ["a", "b"],
                      "answer": "A"} for i in range(150)}  # fmt: skip
    for name in ("Perception", "Comprehension"):
        with open(tmp_path / "many" / "videommmu" / f"{name}_video.json", "w") as f:
            json.dump({name: track}, f)
    capsys.readouterr()
    mm = E.load_benchmark("videommmu", E.Config(data_dir=str(tmp_path / "many")), [])
    assert len({s["id"] for s in mm}) == 300
    assert capsys.readouterr().err.count("\n") == 1
    # our own schema too (the resume log keys rows by id)
    one = {
        "id": "x",
        "problem": "q?",
        "answer": "B",
        "problem_type": "multiple choice",
        "options": ["A. a", "B. b"],
    }
    (tmp_path / "val.jsonl").write_text(json.dumps(one) + "\n" + json.dumps(one) + "\n")
    own = E.load_benchmark("nvr1", E.Config(data_dir=str(tmp_path)), [])
    assert [s["id"] for s in own] == ["x@val.jsonl:1", "x@val.jsonl:2"]
    # the other benchmarks of the run go on: preparing this one raises nothing
    job = E.prepare_benchmark(
        "livesports3k_qa", E.resolve(replace(cfg, max_samples=0, out_dir=str(tmp_path)))
    )
    assert len(job.samples) + len(job.missing) == 3


def test_release_quirks_and_wrong_types_are_named(tmp_path):
    """Video-MMMU's options written as a list literal load (5 of its 900 records); a wrong-typed field
    is an error naming file:record and the field (issue 44.9); MLVU's two needle answers that are no
    candidate's text are named, not guessed (its scorer makes their ground truth "(@)")."""
    os.makedirs(tmp_path / "videommmu")
    rec = {
        "id": "validation_Math_1",
        "question": "q?",
        "answer": "B",
        "question_type": "multiple-choice",
    }
    records = {
        "0": dict(rec, options="['[H+]', 'pH', '[OH-]']"),  # a string holding a list
        "1": dict(rec, options="[1, 2"),
        "2": dict(rec, options="__import__('os').getpid()"),
        "3": dict(rec, options=["a", True]),
        "4": dict(rec, options=None),
        "5": dict(rec, id=["x"], options=["a", "b"]),
        "6": dict(rec, options="[[[[" * 200),
        # texts that start like a label (3 of the 5 records once rejected): lettered A, B, C... only
        "7": dict(rec, options=["M: $57,000; N: $47,000;", "M: $60,000: N: $5;"]),
    }  # fmt: skip
    with open(tmp_path / "videommmu" / "perception_video.json", "w") as f:
        json.dump({"Perception": records}, f)
    bad = []
    s, label = E.load_benchmark("videommmu", E.Config(data_dir=str(tmp_path)), [], bad)
    assert s["options"] == ["A. [H+]", "B. pH", "C. [OH-]"] and s["answer"] == "B"
    assert label["options"] == ["A. M: $57,000; N: $47,000;", "B. M: $60,000: N: $5;"]
    errors = {e["where"].rsplit(":", 1)[1]: e["error"] for e in bad}
    assert "field 'options' holds no list literal (SyntaxError)" in errors["Perception/1"]
    # never run: a call is no literal, and its text is just one option
    assert "a multiple choice of 1 options" in errors["Perception/2"]
    assert "must be a list of option texts, got a list holding bool, str" in errors["Perception/3"]
    assert "field 'options': a multiple choice of 0 options" in errors["Perception/4"]
    assert "field 'id' (['x'])" in errors["Perception/5"]
    assert "holds no list literal" in errors["Perception/6"]
    assert all(e["where"].startswith(str(tmp_path)) for e in bad) and len(bad) == 6
    # a per-field option layout (MINERVA): a list or a flag where an option's text belongs
    ad, row = E.adapter("minerva"), json.load(open(os.path.join(FIXTURES, "minerva.json")))[0]
    vm = {"videoID": "v", "question": "q?", "options": 5, "answer": "A"}  # issue 44.9, as filed
    with pytest.raises(
        DataError, match=r"v.json:2: field \['options', 'choices'\]: a multiple choice of 1"
    ):
        E.to_sample(dict(vm, _file="v"), E.adapter("videomme"), "v.json:2", "/v")
    for wrong in (True, [False], {"a": 1}, [["x"]]):
        with pytest.raises(DataError, match=r"m.json:3: field 'answer_choice_0' must hold option"):
            E.to_sample(dict(row, answer_choice_0=wrong, _file="m"), ad, "m.json:3", "/v")
    for wrong in (["x"], None, {"a": 1}, True):  # an id a resume log could not key by
        with pytest.raises(DataError, match=r"m.json:3: field 'video_id' must be a string or int"):
            E.to_sample(
                dict(row, video_id=wrong, _file="m"),
                E.adapter("vcrbench") | {"id": "video_id"},
                "m.json:3",
                "/v",
            )
    ml = {"video": "n.mp4", "question": "What is caught?", "question_type": "findNeedle",
          "candidates": ["Fishing", "Catching the drone"], "answer": "Catching a flying drone quadcopter"}  # fmt: skip
    # an empty answer among empty candidates: qa_template's last equal one (3_ego.json:120, 7_topic_reasoning:27)
    for candidates, want in ((["a", "", "b"], "B"), (["", "", ""], "C"), (["a", "b"], None)):
        s = E.to_sample(
            dict(ml, candidates=candidates, answer="", _file="3_ego"),
            E.adapter("mlvu"),
            "e:1",
            "/v",
        )
        assert (s and s["answer"]) == want
    with pytest.raises(
        DataError, match=r"n.json:35: .*answer 'Catching a flying drone quadcopter'"
    ):
        E.to_sample(dict(ml, _file="2_needle"), E.adapter("mlvu"), "n.json:35", "/v")


def test_benchmark_template_is_bounded(tmp_path, monkeypatch):
    """A benchmark's prompt template renders in data.render_all's bounded child, as training's: a
    template that would build gigabytes is an error naming the table, the benchmark and the sample,
    before any model loads."""
    table = tmp_path / "benchmarks.yaml"
    bomb = "{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxx{% endfor %}{% endfor %}"
    table.write_text(
        f"worldsense:\n  opts: candidates\n  video: '{{video_path}}'\n  prompt: '{bomb}'\n"
    )
    monkeypatch.setattr(E, "load_adapters", partial(E.load_adapters, str(table)))
    cfg = E.resolve(E.Config(data_dir=FIXTURES, out_dir=str(tmp_path)))
    t = time.perf_counter()
    with pytest.raises(DataError, match=r"yaml: worldsense: fails on sample worldsense:1: .*over"):
        E.prepare_benchmark("worldsense", cfg)
    assert time.perf_counter() - t < 10
    monkeypatch.undo()  # the shipped table: each prompt rendered once, at load
    job = E.prepare_benchmark("worldsense", cfg)
    assert job.missing[0]["prompt_text"].startswith("Carefully watch this video")


def judged(s: dict, bench: str, reply: str) -> dict:
    """The row of a response, rescored from the judge's reply as judge_rows does."""
    row = E.record(s, bench, "p", "an answer")
    rule = E.judge_rule(E.adapter(bench)["judge"], row)
    assert E.judge_messages(rule, row)[-1]["content"].count("an answer") == 1
    row.update(E.judge_verdict(reply, rule))
    return row


def mlvu_extract_scores(text: str, keys: list[str]) -> list[float]:
    """JUNJIE99/MLVU evaluation/generation_evaluation/calculate.py extract_scores, re-typed."""
    scores = []
    for key in keys:
        start_index = text.find(key)
        if start_index == -1:
            continue
        start_number_index = text.find(":", start_index) + 2
        end_number_index = text.find(",", start_number_index)
        scores.append(float(text[start_number_index:end_number_index]))
    return scores


def test_judged_generation_tasks_mlvu_g_avg_and_video_mmlu():
    cfg = E.Config(data_dir=FIXTURES, video_dir="/v")
    ml = {s["question_type"]: s for s in E.load_benchmark("mlvu", cfg, [])}
    ssc, summ = ml["subPlot"], ml["summary"]
    # the judge sees MLVU's own rubric: system text, then the question and the scoring points
    msgs = E.judge_messages(E.judge_rule(E.adapter("mlvu")["judge"], E.record(ssc, "mlvu", "p", "x")),
                            E.record(ssc, "mlvu", "p", "x"))  # fmt: skip
    assert msgs[0]["role"] == "system" and "'score_accuracy': score_acc" in msgs[0]["content"]
    assert "Scoring Points: ['The screen is blue', 'It stays blue']" in msgs[1]["content"]
    replies = {
        "subPlot": "Rationale...\n{'score_accuracy': 4, 'score_relevance': 5, 'total_score': 9}",
        "summary": "{'score_completeness': 2.5, 'score_reliability': 3, 'total_score': 5.5}",
    }
    keys = {"subPlot": ["score_accuracy", "score_relevance"],
            "summary": ["score_completeness", "score_reliability"]}  # fmt: skip
    for t, reply in replies.items():
        row = judged(ml[t], "mlvu", reply)
        assert (
            row["judge_score"] == sum(mlvu_extract_scores(reply, keys[t])) and not row["parse_fail"]
        )
    half = judged(ssc, "mlvu", "{'score_accuracy': 4}")  # a missing key adds 0, as calculate.py
    assert (half["judge_score"], half["parse_fail"]) == (
        sum(mlvu_extract_scores("{'score_accuracy': 4}", keys["subPlot"])),
        True,
    )
    plot, count = ml["plotQA"], ml["count"]
    rows = [E.record(plot, "mlvu", "p", E.gt_letter(plot)), E.record(count, "mlvu", "p", "(D)")]
    rows += [judged(ssc, "mlvu", replies["subPlot"]), judged(summ, "mlvu", replies["summary"])]
    m = E.aggregate(rows, "mlvu")
    # M-Avg over the choice tasks only (plotQA 100, count 0); G-Avg the mean of the 2 tasks' totals
    assert (m["overall"], m["G-Avg"], m["n"]) == (50.0, (9 + 5.5) / 2, 4)
    assert (m["question_type/subPlot"], m["question_type/summary"]) == (9, 5.5)  # SSC, VS
    # Video-MMLU: eval_reason_qa.py's dict literal; calculate_scores.py's means over disciplines
    vm = E.load_benchmark("videommlu", cfg, [])
    rows = [judged(vm[0], "videommlu", "{'pred': 'yes', 'score': 4}"),
            judged(vm[1], "videommlu", "{'pred': 'no', 'score': 1}"),
            judged(vm[1], "videommlu", "The answer is right.")]  # fmt: skip
    assert rows[2]["dropped"] and rows[2]["parse_fail"]  # its scorer skips an unreadable reply
    m = E.aggregate(rows, "videommlu")
    assert (m["overall"], m["score"], m["dropped"]) == (50.0, 2.5, 1)


def test_grounding_without_boxes_is_scored_on_time():
    # gt [0.5, 1.5], "boxes": {}
    st = E.load_benchmark("stvg", E.Config(data_dir=FIXTURES, video_dir="/v"), [])
    empty = st[1]
    assert E.score('<answer>{"time": [0.5, 1.0]}</answer>', empty, E.adapter("stvg"))[
        1
    ] == pytest.approx(0.5)
    assert (
        E.score(
            '<answer>{"time": [0.5, 1.5], "boxes": {"0": [0, 0, 1, 1]}}</answer>',
            empty,
            E.adapter("stvg"),
        )[1]
        == 1.0
    )


# Video-MME-v2 cal_logic / cal_relevance on 4 answers (1 right, 0 wrong, -1 unreadable), worked through the source
V2_GROUPS = [
    ("logic", "[1, 2, 3, 4]", [1, 1, 0, 1], 100 * 4 / 16),
    ("logic", "[1, [2, 3], 4]", [1, 0, 1, 1], 100 * 4 / 12),  # the branch: 1 then 3 counts as 2
    ("logic", "[[1, 2], 3, 4]", [0, 1, 1, 1], 100 / 10),  # 2 alone opens the first step
    ("logic", "[1, 2, 3, 4]", [1, -1, 1, 0], 100 * 9 / 16),  # -1 is truthy: the run goes on
    ("logic", "[[1, 2], 3, 4]", [1, 1, 1, 1], 100.0),
    ("relevance", "", [1, 1, -1, 1], 100 * 4 / 16),
    ("relevance", "", [-1, -1, 0, 0], 0.0),
    ("relevance", "", [1, 1, 1, 0], 100 * 9 / 16),
]


@pytest.mark.parametrize("group_type, structure, marks, want", V2_GROUPS)
def test_videomme_v2_group_scores(group_type, structure, marks, want):
    s = dict(
        MC,
        options=[f"{c}. {c.lower()}" for c in "ABCDEFGH"],
        answer="B",
        group_type=group_type,
        group_structure=structure,
        level=2,
        video_id="v",
    )
    rows = [E.record(s, "videomme_v2", "p", {1: "B", 0: "C", -1: "no idea"}[m]) for m in marks]
    m = E.aggregate(rows, "videomme_v2")
    assert m["group_score"] == pytest.approx(want) and m[
        f"group_score/{group_type}"
    ] == pytest.approx(want)
    assert m["accuracy"] == 100 * marks.count(1) / sum(x != -1 for x in marks)  # valid answers only


def test_official_aggregates():
    cfg = E.Config(data_dir=FIXTURES, video_dir="/v")
    # counting gt 4; rel_direction easy (A), hard (B); appearance
    vsi = E.load_benchmark("vsibench", cfg, [])
    rows = [E.record(s, "vsibench", "p", r) for s, r in zip(vsi, ["4.48", "A", "A", "B"])]
    m = E.aggregate(rows, "vsibench")
    cats = {r["question_type"]: r["score"] for r in rows}
    assert cats["object_rel_direction_easy"] == 1 and cats["object_rel_direction_hard"] == 0
    # overall: mean of 3 categories (counting 80, rel_direction = mean(easy 100, hard 0) = 50, the last one's)
    assert m["category/object_rel_direction"] == 50
    assert m["overall"] == pytest.approx((80 + 50 + 100 * rows[3]["score"]) / 3)
    ovo = [
        dict(r, error="", parse_fail=False)
        for r in (
            {"score": 1, "ovo_category": "backward", "ovo_task": "EPM"},
            {"score": 0, "ovo_category": "backward", "ovo_task": "EPM"},
            {"score": 1, "ovo_category": "backward", "ovo_task": "HLD"},
            {"score": 0, "ovo_category": "forward", "ovo_task": "REC"},
        )
    ]
    # backward = mean(EPM 50, HLD 100) = 75, not the pooled 66.7
    m = E.aggregate(ovo, "ovobench_evr1")
    # overall: of the categories
    assert (m["ovo_category/backward"], m["overall"], m["accuracy"]) == (
        75,
        37.5,
        50,
    )
    # two videos of 4 questions: 3 of 4 right, then 1 of 4
    v2 = E.load_benchmark("videomme_v2", cfg, [])
    answers = [s["answer"] if i in (0, 1, 2, 4) else "H" for i, s in enumerate(v2)]
    m = E.aggregate(
        [E.record(s, "videomme_v2", "p", a) for s, a in zip(v2, answers)], "videomme_v2"
    )
    assert m["group_score"] == pytest.approx(100 * (9 / 16 + 1 / 16) / 2) and m["accuracy"] == 50
    assert m["group_score/relevance"] == pytest.approx(100 * 9 / 16) and m["level/2"] == 25
    ch = E.load_benchmark("charades_sta", cfg, [])[0]  # gt [0, 1.2]
    ious = [
        E.record(ch, "charades_sta", "p", r)["score"]
        for r in ('{"time": [0.0, 0.96]}', "0.3 - 0.78", "no")
    ]
    assert ious == pytest.approx([0.8, 0.4, 0.0])
    m = E.aggregate(
        [E.record(ch, "charades_sta", "p", r) for r in ('{"time": [0.0, 0.96]}', "0.3 - 0.78")],
        "charades_sta",
    )
    assert (m["R@0.3"], m["R@0.5"], m["R@0.7"], m["mIoU"]) == pytest.approx((100, 50, 50, 60))
    mlvu = [
        dict(score=v, question_type=t, error="", parse_fail=False)
        for v, t in ((1, "count"), (0, "count"), (1, "order"))
    ]
    assert E.aggregate(mlvu, "mlvu")["overall"] == 75
    lv = [
        dict(score=v, question_type=t, error="", parse_fail=False)
        for v, t in ((1, ["ER", "KIR"]), (0, ["ER"]))
    ]
    m = E.aggregate(lv, "lvbench")  # multi-label
    assert (m["question_type/ER"], m["question_type/KIR"]) == (50, 100)


def test_broken_records_are_reported_not_fatal(tmp_path):
    good = {
        "videoID": "x",
        "question": "q?",
        "options": ["A. a", "B. b"],
        "answer": "B",
        "question_id": "ok",
    }
    lines = [
        good,
        dict(good, options=5, question_id="b1"),
        dict(good, answer=-70, question_id="b2"),
        [1, 2],
        dict(good, question=5, question_id="b3"),
        "{not json",
    ]
    (tmp_path / "videomme.jsonl").write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    )
    bad = []
    samples = E.load_benchmark(
        "videomme", E.Config(data_dir=str(tmp_path), video_dir=str(tmp_path)), [], bad
    )
    assert [s["id"] for s in samples] == ["ok"]
    assert [b["where"].rsplit(":", 1)[1] for b in bad] == [
        "2",
        "3",
        "4",
        "5",
        "6",
    ]  # file:line, in file order
    assert (
        "field ['options', 'choices']: a multiple choice of 1 options" in bad[0]["error"]
        and "JSON object" in bad[2]["error"]
        and "not JSON" in bad[4]["error"]
    )
    # a record without qa: no sample at all
    (tmp_path / "lvbench.jsonl").write_text(json.dumps({"key": "v"}) + "\n")
    with pytest.raises(
        DataError,
        match=r"lvbench: 0 samples loaded from .*lvbench.jsonl \(1 bad records, 0 without "
        r"ground truth; first: .*lvbench.jsonl:1: field 'qa' must be a list",
    ):
        E.load_benchmark("lvbench", E.Config(data_dir=str(tmp_path)), [], [])
    with pytest.raises(
        DataError, match=r"videomme: 5 bad records, first: .*videomme.jsonl:2: field \[.options"
    ):
        # without a bad list: raised
        E.load_benchmark("videomme", E.Config(data_dir=str(tmp_path)), [])


def test_benchmark_table_is_checked(tmp_path):
    path = tmp_path / "benchmarks.yaml"
    path.write_text("mine:\n  video: '{v}.mp4'\n  opts: choices\n  keys: [task]\n  questions: qs\n")
    with pytest.raises(
        ValueError, match=r"benchmarks.yaml: benchmark 'mine': unknown field\(s\) \['questions'\]"
    ):
        E.load_adapters(str(path))
    path.write_text("mine:\n  read: letters\n")
    with pytest.raises(
        ValueError, match=r"benchmarks.yaml: benchmark 'mine': unknown reader 'letters'"
    ):
        E.load_adapters(str(path))
    path.write_text(
        "mine:\n  type: {field: kind, map: {mc: multiple choice}, defualt: open-ended}\n"
    )
    with pytest.raises(
        ValueError,
        match=r"benchmarks.yaml: benchmark 'mine': a type or derive rule takes field, map",
    ):
        E.load_adapters(str(path))
    path.write_text("mine:\n  judge: {subPlot: {user: '{pred}', key: [score]}}\n")
    with pytest.raises(ValueError, match=r"'mine': a judge rule takes user, keys and"):
        E.load_adapters(str(path))
    # the defaults fill in, an explicit null stays
    path.write_text("mine:\n  opts: null\n  video: '{v}.mp4'\n")
    assert E.load_adapters(str(path)) == {
        "mine": {
            "q": "question",
            "opts": None,
            "ans": "answer",
            "video": "{v}.mp4",
            "read": [["[{L}]", 0]],
        }
    }


def test_checked_before_the_engine(tmp_path):
    t = time.perf_counter()
    with pytest.raises(ValueError, match="unknown benchmark 'videome'; known: nvr1, videomme"):
        asyncio.run(
            E.evaluate(
                E.Config(benchmarks="videomme,videome", data_dir=FIXTURES, out_dir=str(tmp_path))
            )
        )
    with pytest.raises(
        FileNotFoundError, match=r"mvbench: no annotation file \(.jsonl, .json, .parquet, .csv"
    ):
        asyncio.run(
            E.evaluate(
                E.Config(benchmarks="mvbench", data_dir=str(tmp_path), out_dir=str(tmp_path))
            )
        )
    # 64 frames x 262,144 px do not fit in 4,096
    with pytest.raises(ValueError, match="10699 vision tokens"):
        asyncio.run(
            E.evaluate(E.Config(max_model_len=4096, data_dir=FIXTURES, out_dir=str(tmp_path)))
        )
    assert time.perf_counter() - t < 5
    # the defaults fit each other
    assert E.resolve(E.Config(model=str(tmp_path))).max_prompt_len == 16384 - 64
    job = E.prepare_benchmark(
        "videomme",
        E.resolve(E.Config(data_dir=FIXTURES, video_dir=str(tmp_path), out_dir=str(tmp_path))),
    )
    assert (
        len(job.missing) == 3 and len(job.samples) == 0 and "missing media" in job.bad[0]["error"]
    )


# ---------------------------------------------------------------------------------------------------
# the real pipeline on the tiny checkpoint
def run_cfg(tiny_model, videos, synth, out, **kw):
    # the fixtures plus our own schema (the synthetic val set) as benchmark "nvr1"
    ann = out.parent / "ann"
    if not ann.exists():
        ann.mkdir()
        for f in os.listdir(FIXTURES) + ["nvr1"]:
            (ann / f).symlink_to(synth if f == "nvr1" else os.path.join(FIXTURES, f))
    base = dict(
        model=tiny_model,
        benchmarks="nvr1,videomme,vsibench,charades_sta",
        data_dir=str(ann),
        video_dir=videos,
        out_dir=str(out),
        max_tokens=12,
        max_model_len=1024,
        video_fps=4.0,
        video_max_frames=8,
        video_max_pixels=3136,
        image_max_pixels=3136,
        cache_dir=str(out) + "-frames",
        max_in_flight=8,
        allow_failures=True,
    )
    return E.Config(**{**base, **kw})


def read(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


@pytest.mark.slow
def test_async_pipeline_sync_loop_resume_hf(tiny_model, videos, synth, tmp_path):
    from transformers import AutoProcessor

    cfg = run_cfg(tiny_model, videos, synth, tmp_path / "async")
    processor = AutoProcessor.from_pretrained(tiny_model)
    # one AsyncLLM (an engine-core process of its own) for the run and its resume, as bench/evaluate.py passes one
    # in; evaluate()'s own engine, started and shut down inside, is the README command's test below
    engine = E.make_engine(E.resolve(cfg), processor.tokenizer)

    async def run(c):
        return await E.evaluate(c, engine, processor)

    try:
        res = asyncio.run(async_run_and_resume(cfg, run, videos, synth, tmp_path))
    finally:
        engine.shutdown()
        engine.shutdown = E.shut_down  # as evaluate() does: no second shutdown at interpreter exit
    a = {b: read(tmp_path / "async" / b / "samples.jsonl") for b in cfg.benchmarks.split(",")}
    # the plain synchronous loop (rollout.VLLMEngine, batch by batch): identical greedy responses and scores
    s_res = asyncio.run(
        E.evaluate(replace(cfg, out_dir=str(tmp_path / "sync"), engine="sync", batch_size=3))
    )
    for b in ("nvr1", "vsibench", "charades_sta"):
        assert read(tmp_path / "sync" / b / "samples.jsonl") == a[b], b
        assert s_res[b]["metrics"] == res[b]["metrics"]
    # the HF fallback runs the same adapters and scoring (same row per doc_id)
    h = asyncio.run(
        E.evaluate(
            replace(cfg, benchmarks="nvr1", engine="hf", out_dir=str(tmp_path / "hf"), max_tokens=4)
        )
    )
    hrows = read(tmp_path / "hf" / "nvr1" / "samples.jsonl")
    assert [r["doc_id"] for r in hrows] == [r["doc_id"] for r in a["nvr1"]] and h["nvr1"][
        "metrics"
    ]["n"] == len(hrows)


async def async_run_and_resume(cfg, run, videos, synth, tmp_path) -> dict:
    """The AsyncLLM pipeline on 4 benchmarks (one video missing), then a resume after a simulated crash, in one event
    loop (AsyncLLM's output handler lives in the loop that first used it). Returns the first run's results."""
    os.rename(os.path.join(videos, "videomme", "vid2.mp4"), str(tmp_path / "vid2.mp4"))
    try:  # one missing video: listed as unevaluable, never scored
        res = await run(cfg)
    finally:
        os.rename(str(tmp_path / "vid2.mp4"), os.path.join(videos, "videomme", "vid2.mp4"))
    assert res["videomme"]["metrics"]["n"] == 2 and res["videomme"]["unevaluable"] == 1
    assert "vid2.mp4" in res["videomme"]["failed_samples"][0]["error"]
    assert res["nvr1"]["metrics"]["n"] == len(data.load_samples(os.path.join(synth, "val.jsonl")))
    assert 0 < res["nvr1"]["engine_busy"] <= 1 and res["charades_sta"]["metrics"]["mIoU"] >= 0
    md = (tmp_path / "async" / "results.md").read_text()
    assert "| vsibench | overall |" in md and "| charades_sta | R@0.5 |" in md
    a = read(tmp_path / "async" / "nvr1" / "samples.jsonl")
    assert any(r["resps"][0] for r in a)
    # resume: a crash after 2 lines, the third torn mid-write; the rerun completes the log, no duplicates
    log = tmp_path / "async" / "nvr1" / "samples.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:2]) + lines[2][:25])
    res2 = await run(replace(cfg, benchmarks="nvr1"))
    assert (res2["nvr1"]["resumed"], res2["nvr1"]["torn_lines"]) == (2, 1)
    assert read(log) == a and res2["nvr1"]["metrics"] == res["nvr1"]["metrics"]
    # other settings: refused, not resumed
    with pytest.raises(DataError, match="differs in .*max_tokens"):
        await run(replace(cfg, benchmarks="nvr1", max_tokens=5))
    return res


def test_two_models_default_folder_and_exit_code(tiny_model, synth, tmp_path, monkeypatch):
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model, other)
    monkeypatch.chdir(tmp_path)  # the default out_dir is relative: runs/eval/<model>-<hash>
    base = E.Config(
        model=tiny_model,
        data_dir=synth,
        engine="hf",
        max_tokens=2,
        max_samples=3,
        max_model_len=1024,
        video_max_frames=8,
        video_max_pixels=3136,
        cache_dir="",
    )
    first = asyncio.run(E.evaluate(base))["nvr1"]
    second = asyncio.run(E.evaluate(replace(base, model=str(other))))["nvr1"]
    # its own answers, in its own folder
    assert first["samples"] != second["samples"] and second["resumed"] == 0
    assert read(second["samples"])[0]["doc_id"] == read(first["samples"])[0]["doc_id"]
    # another model's folder, named explicitly: refused
    with pytest.raises(DataError, match="differs in model"):
        asyncio.run(
            E.evaluate(
                replace(
                    base,
                    model=str(other),
                    out_dir=os.path.dirname(os.path.dirname(first["samples"])),
                )
            )
        )
    (tmp_path / "ann").mkdir()
    with open(tmp_path / "ann" / "nvr1.jsonl", "w") as f:  # one sample whose video is missing
        f.write(
            json.dumps(
                dict(data.load_samples(os.path.join(synth, "val.jsonl"))[0], videos=["gone.mp4"])
            )
            + "\n"
        )
    broken = replace(base, data_dir=str(tmp_path / "ann"), out_dir=str(tmp_path / "broken"))
    assert E.main(broken) == 1 and E.main(replace(broken, allow_failures=True)) == 0


@background("readme_eval")
def readme_eval(tmp_path_factory):
    """The README's evaluate.py command in a fresh folder holding .cache/ (conftest's background lane). Returns
    (that folder, the process)."""
    import make_synthetic_data
    from conftest import tiny_model_dir

    tiny_model, tmp_path = tiny_model_dir(), tmp_path_factory.mktemp("readme")
    make_synthetic_data.make(
        str(tmp_path / ".cache" / "data" / "color"),
        ["color"],
        num_train=1,
        num_val=3,
        seed=0,
        size=56,
        fps=4,
        seconds=2.0,
    )
    os.symlink(os.path.dirname(tiny_model), tmp_path / ".cache" / "models")
    cmd = f"python evaluate.py --model {tiny_model} --benchmarks nvr1 --data-dir .cache/data/color"  # the README's
    args = [sys.executable, os.path.join(ROOT, "evaluate.py")] + cmd.split()[2:]
    env = user_env("VLLM_CPU_KVCACHE_SPACE")  # as written: the CPU default KV cache

    def run():
        return tmp_path, subprocess.run(
            args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )

    return run


@pytest.mark.lane("readme_eval")
def test_readme_command_as_written(tmp_path_factory):
    tmp_path, out = lane_result("readme_eval", tmp_path_factory)
    assert out.returncode == 0, out.stderr[-3000:]
    # progress, and no exit traceback
    assert "Traceback" not in out.stderr and "nvr1: 3/3" in out.stderr
    # quiet (issue 29: 116 lines, vLLM's engine processes' among them): our warning, progress, scores, results path
    lines = quiet_lines(out.stdout, out.stderr)
    assert len(lines) <= 6 and not [x for x in lines if LIBRARY_NOISE.search(x)], (
        out.stdout + out.stderr
    )
    # our own warnings still print
    assert any(x.startswith("warning: a video can take") for x in lines)
    folder = next((tmp_path / "runs" / "eval").iterdir())
    res = json.loads((folder / "results.json").read_text())["benchmarks"]["nvr1"]
    assert res["metrics"]["n"] == 3 and res["unevaluable"] == 0


def test_ovobench_release_records_clips_and_scores(tmp_path):
    """ovo_bench_new.json as published: a question a record, a forward task's probes one each (id <id>_<probe>, the
    official clip's name), each cut at ceil(realtime); scored and averaged as utils/OVOBenchScore.py does."""
    ovo = E.load_benchmark("ovobench", E.Config(data_dir=FIXTURES, video_dir="/v"), [])
    assert [
        (s["id"], s["task"], s["category"], s["problem_type"], s["answer"], s["video_end"])
        for s in ovo
    ] == [
        ("0", "EPM", "backward", "multiple choice", "B", 2.0),
        ("1319", "OCR", "realtime", "multiple choice", "C", 1.0),
        ("1468_0", "CRR", "forward", "boolean", "no", 1.0),
        ("1468_1", "CRR", "forward", "boolean", "yes", 2.0),
        ("1516_0", "SSR", "forward", "boolean", "yes", 1.0),
        ("1516_1", "SSR", "forward", "boolean", "no", 1.0),
        ("1558_0", "REC", "forward", "counting", "0", 1.0),
        ("1558_1", "REC", "forward", "counting", "1", 2.0),
    ]
    assert (
        ovo[3]["where"].endswith("ovobench.json:3.test_info[1]")
        and ovo[4]["problem"] == "paint it red"
    )
    assert ovo[6]["problem"] == "How many times did they turn the screen green?" and ovo[0][
        "videos"
    ] == ["/v/ovobench/Ego4D/clips/ego0.mp4"]
    # the official rules: the letter in the answer; "N"/"Y" exactly, else "No"/"Yes" inside; all digit runs joined
    answers = ["B", "C", "N", "No, not yet", "Yes.", "Y", "0", "1 time, maybe 2"]
    rows = [E.record(s, "ovobench", "p", a, extraction="official") for s, a in zip(ovo, answers)]
    assert [r["score"] for r in rows] == [1, 1, 1, 0, 1, 0, 1, 0]
    # tasks EPM 100, OCR 100, CRR 50, SSR 50, REC 50 (a probe counts one)
    m = E.aggregate(rows, "ovobench")
    assert (m["task/CRR"], m["category/forward"], m["category/realtime"]) == (50, 50, 100)
    # "Total Avg."; micro
    assert m["overall"] == pytest.approx((100 + 100 + 50) / 3) and m["accuracy"] == 62.5
    bad_records = [  # no realtime; a probe without it; probes not a list; a realtime that is not a number
        {
            "id": 7,
            "task": "EPM",
            "video": "a.mp4",
            "question": "q?",
            "options": ["x", "y"],
            "gt": 1,
        },
        {"id": 8, "task": "REC", "video": "b.mp4", "activity": "jump", "test_info": [{"count": 1}]},
        {"id": 9, "task": "SSR", "video": "c.mp4", "test_info": {"realtime": 3}},
        {
            "id": 10,
            "task": "CRR",
            "video": "d.mp4",
            "question": "q?",
            "test_info": [{"realtime": "17", "type": 1}],
        },
    ]
    (tmp_path / "ovobench.json").write_text(json.dumps(bad_records))
    bad = []
    with pytest.raises(DataError, match="0 samples loaded"):
        E.load_benchmark("ovobench", E.Config(data_dir=str(tmp_path), video_dir="/v"), [], bad)
    assert [b["error"].split("ovobench.json:")[1] for b in bad] == [
        "1: missing field 'realtime'",
        "2.test_info[0]: missing field 'realtime'",
        "3: field 'test_info' must be a list of question objects",
        "4.test_info[0]: field 'realtime' must be a time in seconds, got '17'",
    ]


def test_official_prompts_verbatim():
    """The prompts the YAML calls official render as the benchmarks' own code writes them (typed from the sources)."""
    cfg = E.Config(data_dir=FIXTURES, video_dir="/v")
    first = {b: E.load_benchmark(b, cfg, [])[0] for b in ("videomme", "holmes", "mmvu")}
    got = {b: data.render_prompt(s, E.adapter(b)["prompt"]) for b, s in first.items()}
    vm = first["videomme"]  # the README's prompt without subtitles: the question bare
    assert got["videomme"] == (
        "Select the best answer to the following multiple-choice question based on the video. "
        "Respond with only the letter (A, B, C, or D) of the correct option.\n"
        f"{vm['problem']}\n" + "\n".join(vm["options"]) + "\nThe best answer is:"
    )
    assert got["holmes"] == (  # Video-Holmes evaluate.py: options joined as "A: text, B: text"
        "Based on the given video, reason and answer the single-choice question. Provide your reasoning between the "
        "<think> and </think> tags, and then give your final answer between the <answer> and </answer> tags. The "
        "question is: Why did the man leave?. The options are: A: reason A, B: reason B, C: reason C, D: reason D, "
        "E: reason E, F: reason F. Your answer:"
    )
    # MMVU's DO_PROMPT
    assert got["mmvu"] == (
        "\nQuestion: What is the background color of the video?\nA: red\nB: green\nC: blue\n"
        "D: yellow\nE: white\n\nDo not generate any intermediate reasoning process. Answer directly "
        "with the option letter from the given choices.\n"
    )
    # constant.py's templates, filled as utils/OVOBench.py build_prompt
    ovo = E.load_benchmark("ovobench", cfg, [])
    end = "Do not include any additional text or explanation in your response.\n"
    assert data.render_prompt(ovo[0], E.adapter("ovobench")["prompt"]) == (
        "\nQuestion: What color was the screen before?\nOptions:\nA. red; B. green; C. blue; D. yellow;\n\nRespond "
        "only with the letter corresponding to your chosen option (e.g., A, B, C). \n" + end
    )
    assert data.render_prompt(ovo[4], E.adapter("ovobench")["prompt"]) == (
        "\nYou're watching a tutorial video which contain a sequential of steps. \nThe following is one step from the "
        "whole procedures: \npaint it red\nYour task is to determine if the man or woman in the video is currently "
        "performing this step.\nAnswer only with “Yes” or “No”.\n" + end
    )
    assert data.render_prompt(ovo[6], E.adapter("ovobench")["prompt"]) == (
        "\nYou're watching a video in which people may perform a certain type of action repetively. \nThe person "
        "performing this kind of action are referred to as 'they' in the following statement.\nYou're task is to "
        "count how many times have different people in the video perform this kind of action in total.\nOne complete "
        "motion counts as one. \nNow, answer the following question: How many times did they turn the screen green?"
        "\nProvide your answer as a single number (e.g., 0, 1, 2, 3…) indicating the total count.\n"
        + end
    )


def test_worldsense_sends_the_soundtrack_to_an_omni_model(tmp_path):
    """WorldSense's official audio-visual setting (benchmarks.yaml `audio`, lmms-eval's frames-and-audio prompt): an
    Omni model gets each video's soundtrack, interleaved with its frames (audio tokens in the prompt); a model that
    hears nothing (Qwen2.5-VL) is evaluated without it, warned."""
    import numpy as np
    from conftest import tiny_model_dir
    from make_synthetic_data import write_video
    from transformers import AutoProcessor

    videos = tmp_path / "videos" / "worldsense"
    videos.mkdir(parents=True)
    write_video(str(videos / "ws0.mp4"), np.zeros((8, 56, 56, 3), np.uint8), 4.0, tone=440.0)
    omni = tiny_model_dir("qwen2_5_omni")
    settings = dict(
        data_dir=FIXTURES, video_dir=str(tmp_path / "videos"), out_dir=str(tmp_path / "out")
    )
    deaf = E.prepare_benchmark("worldsense", E.resolve(E.Config(**settings)))
    job = E.prepare_benchmark("worldsense", E.resolve(E.Config(model=omni, **settings)))
    assert job.cfg.video_audio and job.run["video_audio"] and not deaf.cfg.video_audio
    load, stats = E.make_loader(AutoProcessor.from_pretrained(omni), job.cfg, "worldsense")
    p = load(job.samples[0])
    audio_id = AutoProcessor.from_pretrained(omni).tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert p.audios and p.prompt_ids.count(audio_id) == 50  # 2 s of sound, 25 tokens a second
    assert "These are the frames of a video and the corresponding audio." in p.text
    assert p.text.count("\n") > job.samples[0]["prompt_text"].count(
        "\n"
    )  # the chat template around it
    assert job.samples[0]["prompt_text"].endswith("D. yellow\n")

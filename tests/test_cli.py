"""The entry scripts as a user runs them: `--config` in every form, out_dir rules, one-line errors, --help. Each
subprocess stops before any model loads (a few seconds each).

    .venv/bin/python -m pytest -q tests/test_cli.py
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, Share, color_data_dir, share_of, tiny_model_dir, two_rank_share

import cache_frames
import ckpt
import common
import evaluate
import train

OFFLINE_HUB = {
    "HF_HUB_OFFLINE": "0",
    "HF_ENDPOINT": "http://127.0.0.1:9",
}  # a hub that refuses at once: no network


def run(*cmd, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *cmd],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def write(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def one_line_error(p: subprocess.CompletedProcess, *words: str):
    """rc 2, `error: ...` naming every word as the last line of stderr, no traceback."""
    last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    assert p.returncode == 2 and "Traceback" not in p.stderr and last.startswith("error: "), (
        p.stderr[-3000:]
    )
    assert all(w in last for w in words), (words, last)


@pytest.fixture(scope="module")
def train_cli(tmp_path_factory, tiny_model, color_data) -> tuple:
    """The inputs of this module's train.py command lines in one folder, and the command lines run in one process
    (test_faults' TRAIN_DRIVER: one start-up, ~6 CPU s, not one each), with a hub that refuses at once
    (OFFLINE_HUB). Returns (folder, key -> finished command, its output as stderr)."""
    from test_faults import drive

    d = tmp_path_factory.mktemp("train_cli")
    sample = {
        "id": "q",
        "problem": "q?",
        "answer": "A",
        "options": ["A. x", "B. y"],
        "problem_type": "multiple choice",
    }
    data = write(d, "d.jsonl", json.dumps(sample) + "\n")
    write(d, "a.yaml", f"train_data: {d}/missing.jsonl\nlr: 0.5\n")
    write(d, "b.yaml", f"train_data: {data}\nval_data: ''\ngroup_size: 2\n")
    write(d, "c.yaml", "model: Qwen/no-such-model\nlr: 0.25\n")
    write(d, "typo.yaml", "learning_rate: 1\n")
    (d / "step_1").mkdir()
    (d / "step_1" / "meta.json").write_text("{}")
    tiny = ["--config", "configs/tiny_cpu.yaml"]
    color = ["--train-data", f"{color_data}/train.jsonl", "--val-data", ""]
    fake_checkpoint(d / "other", train.load_config([*tiny, *color, "--out-dir", str(d / "other")]))
    runs = {
        "config forms": [
            *("--config=" + str(d / "a.yaml"), "--config", str(d / "b.yaml"), str(d / "c.yaml")),
            *("--out-dir", str(d / "run-forms")),
        ],
        "typo": ["--config", str(d / "typo.yaml")],
        "bound": [*tiny, "--group-size", "0"],
        "bug": [*tiny, *color, "--out-dir", str(d / "run"), "--resume", str(d / "step_1")],
        "other settings": [
            *(*tiny, *color, "--out-dir", str(d / "other"), "--resume", "auto"),
            *("--lr", "0.5", "--group-size", "4", "--max-steps", "80"),
        ],
        "no such folder": [
            *(*tiny, "--model", ".cache/models/tiny-qwen25_vl"),
            *("--train-data", f"{color_data}/train.jsonl", "--val-data", f"{color_data}/val.jsonl"),
        ],
    }
    hub = [f"{k}={v}" for k, v in OFFLINE_HUB.items()]
    # the driver's output is stdout and stderr in one: read as stderr here
    done = {
        k: subprocess.CompletedProcess(p.args, p.returncode, "", p.stdout)
        for k, p in drive(runs, ["env", *hub, sys.executable]).items()
    }
    return d, done


def test_config_flag_every_form(tmp_path, tiny_model, train_cli):
    """`--config=a.yaml` (was ignored, rc 0), `--config a.yaml b.yaml` and repeated `--config` (only the first was
    applied, the last recorded): every file applied in order, flags over them, `config` records what was applied; in
    train.py, cache_frames.py and evaluate.py alike. train.py gets there through a hub model without a network, which
    fails in seconds with the way out (was 2.5 minutes of retries, then an OSError traceback)."""
    # a.yaml: a missing train_data, lr 0.5; b.yaml: d.jsonl, group_size 2; c.yaml: a hub model
    d, done = train_cli
    data, a, b, c = (str(d / f) for f in ("d.jsonl", "a.yaml", "b.yaml", "c.yaml"))
    for argv in (
        ["--config=" + a, "--config", b, c],
        ["--config", a, b, "--config=" + c],
        ["--config", a, b, c],
    ):
        cfg = train.load_config([*argv, "--group-size", "4"])
        assert (cfg.train_data, cfg.group_size, cfg.lr, cfg.config) == (data, 4, 0.25, (a, b, c))
    one_line_error(
        done["config forms"],
        "Qwen/no-such-model: no network",
        "set HF_HUB_OFFLINE=1 or give a local path",
    )
    # cache_frames.py reads training YAMLs alike (the later file's model and data); a missing data file: before the
    # processor
    ca = write(tmp_path, "ca.yaml", "model: Qwen/no-such-model\nvideo_max_frames: 5\n")
    cb = write(tmp_path, "cb.yaml", f"model: {tiny_model}\ntrain_data: {data}\nval_data: ''\n")
    cc = write(tmp_path, "cc.yaml", f"train_data: {tmp_path}/cc_missing.jsonl\n")
    c1 = cache_frames.load_config(["--config=" + ca, "--config", cb])
    assert (c1.config, c1.data, c1.video_max_frames) == ((ca, cb), [data], 5)
    one_line_error(
        run("scripts/cache_frames.py", "--config=" + ca, "--config", cb, cc, "--workers", "1"),
        f"{tmp_path}/cc_missing.jsonl: no such file",
        f"of {ca} {cb} {cc}",
    )
    with pytest.raises(ValueError, match="no data files"):  # was: `videos 0`, rc 0
        cache_frames.main(cache_frames.Config())
    # evaluate.py: a YAML of its own settings
    ea = write(tmp_path, "ea.yaml", "benchmarks: nosuch\nmax_tokens: 8\n")
    eb = write(tmp_path, "eb.yaml", "benchmarks: nosuch2\n")
    e = common.load_config(evaluate.Config, ["--config", ea, eb])
    assert (e.benchmarks, e.max_tokens, e.config) == ("nosuch2", 8, (ea, eb))
    one_line_error(
        run("evaluate.py", "--config=" + ea, "--config", eb), "unknown benchmark 'nosuch2'"
    )


def fake_checkpoint(out, cfg) -> str:
    """out/ckpt/step_00000002 with the meta.json ckpt.save writes (its config) and `latest` naming it."""
    step = out / "ckpt" / "step_00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2, "config": dataclasses.asdict(cfg)}))
    (out / "ckpt" / "latest").write_text(step.name)
    return str(step)


def test_out_dir_rules(tmp_path, color_data, train_cli):
    """A fresh run into a folder holding another run's checkpoints is refused (it kept the old ckpt/, and a later
    `--resume auto` resumed the wrong run); a resume with other settings than the checkpoint's is refused naming them
    (`--lr 0.5 --group-size 4` was accepted silently), but for the MAY_CHANGE_ON_RESUME fields or
    with --allow-config-change."""
    out = tmp_path / "run"
    args = [
        "--config",
        "configs/tiny_cpu.yaml",
        "--train-data",
        f"{color_data}/train.jsonl",
        "--val-data",
        "",
        "--out-dir",
        str(out),
    ]
    step = fake_checkpoint(out, train.load_config(args))
    with pytest.raises(
        ValueError, match=f"{out} holds another run's checkpoints: continue it with --resume auto"
    ):
        train.check_files(train.load_config(args), ckpt.find(str(out), ""))
    for ok in (
        ["--max-steps", "80", "--eval-every", "0", "--save-every", "5", "--stop-grace-s", "9"],
        ["--lr", "0.5", "--allow-config-change"],
    ):
        train.check_files(train.load_config([*args, "--resume", "auto", *ok]), step)
    # train.py on these args' checkpoint in d/other, resumed with --lr 0.5 --group-size 4 --max-steps 80
    d, done = train_cli
    p = done["other settings"]
    one_line_error(
        p,
        f"{d}/other/ckpt/step_00000002 was trained with other settings",
        "group_size 8 -> 4",
        "lr 0.001 -> 0.5",
        "--allow-config-change",
    )
    assert "max_steps" not in p.stderr


def test_bench_help_does_not_start_it():
    p = run("bench/rollout.py", "--help")
    assert (
        p.returncode == 0 and "Per-step rollout time" in p.stdout and "bench total" not in p.stdout
    )


def test_results_md_counts_are_counts(tmp_path):
    """results.md: counts as counts (`parse_fail 55.00` read as a percentage; it was 55 of 64), scores in percent; no
    `n` column (it showed the benchmark's n beside each breakdown), `failed` only inside unevaluable."""
    metrics = {
        "n": 64,
        "accuracy": 12.5,
        "parse_fail": 55,
        "failed": 1,
        "dropped": 0,
        "problem_type/boolean": 10.0,
    }
    evaluate.write_results(
        {"nvr1": {"metrics": metrics, "unevaluable": 1, "judge": "not needed"}},
        evaluate.Config(out_dir=str(tmp_path)),
    )
    rows = (tmp_path / "results.md").read_text().splitlines()[2:]
    assert rows == [
        "| benchmark | metric | value |",
        "|---|---|---|",
        "| nvr1 | n | 64 |",
        "| nvr1 | accuracy | 12.50 |",
        "| nvr1 | parse_fail | 55 |",
        "| nvr1 | dropped | 0 |",
        "| nvr1 | problem_type/boolean | 10.00 |",
        "| nvr1 | unevaluable (not scored) | 1 |",
    ]


def test_engine_memory_errors_name_our_knobs():
    """vLLM's start-up failure for want of KV cache names gpu_memory_utilization, which on CPU sizes nothing: the
    error train.py and evaluate.py print names VLLM_CPU_KVCACHE_SPACE here and max_model_len, in one line; other
    errors pass through as they are."""
    from rollout import start_errors

    vllm_text = (
        "To serve at least one request with the models's max seq len (262144), (16.0 GiB KV cache is\n"
        "needed, which is larger than the available KV cache memory (1.0 GiB). Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    )
    with pytest.raises(ValueError) as e:
        with start_errors(262144):
            raise ValueError(vllm_text)
    text = str(e.value)
    assert (
        "\n" not in text and "VLLM_CPU_KVCACHE_SPACE" in text and "--max-model-len (262144)" in text
    ), text
    assert "16.0 GiB KV cache is needed" in text and e.value.__cause__ is None
    with pytest.raises(ValueError, match="^unknown architecture$"):
        with start_errors(4096):
            raise ValueError("unknown architecture")


QUIET_PROBE = """
import logging, sys, warnings
import common
common.quiet()
logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("vllm.platforms.cpu").warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
logging.getLogger("vllm.platforms.cpu").warning("a vLLM warning quiet() does not list")
logging.getLogger("torch._opaque_base").error("an error on a listed logger")
warnings.warn("our own warning", UserWarning)
warnings.warn("`torch.distributed.reduce_op` is deprecated, elsewhere", FutureWarning)
print("VLLM_LOGGING_LEVEL", common.os.environ.get("VLLM_LOGGING_LEVEL"))
"""


@pytest.mark.parametrize("debug", [False, True])
def test_quiet_drops_only_the_listed_lines(debug):
    """common.quiet (each entry script's start): the listed library lines go, anything else still prints (other
    warnings, errors, a listed text from another module); --debug keeps every line and vLLM's INFO level."""
    env = dict(os.environ)
    env.pop("VLLM_LOGGING_LEVEL", None)
    p = subprocess.run(
        [sys.executable, "-c", QUIET_PROBE, *["--debug"] * debug],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert ("Triton is not installed" in p.stderr) == debug
    assert (
        "a vLLM warning quiet() does not list" in p.stderr
        and "an error on a listed logger" in p.stderr
    )
    assert (
        "our own warning" in p.stderr and "reduce_op` is deprecated, elsewhere" in p.stderr
    )  # not from vLLM
    assert f"VLLM_LOGGING_LEVEL {None if debug else 'WARNING'}" in p.stdout


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(train_cli):
    """common.cli: our own checks (a config error: a YAML key, a bound) print one line, exit 2; any other exception
    (here a KeyError on a checkpoint's meta.json without its config, which no check of ours raises) keeps its
    traceback, and train.py also writes it to out_dir/error.log (before: a ValueError anywhere printed one line)."""
    d, done = train_cli
    one_line_error(done["typo"], "typo.yaml: unknown key 'learning_rate'")
    p = done["bound"]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "error: invalid config:" in p.stderr and "group_size must be > 0, got 0" in p.stderr
    p = done["bug"]  # --resume d/step_1, whose meta.json is {}
    assert p.returncode == 1 and "Traceback" in p.stderr and "KeyError: 'config'" in p.stderr, (
        p.stderr[-3000:]
    )
    log = (d / "run" / "error.log").read_text()
    assert log.startswith("Traceback") and "check_files" in log and "KeyError: 'config'" in log, log


def test_a_local_model_path_that_is_no_folder_is_named_not_the_network(monkeypatch, train_cli):
    """A model path that looks local (./, ../, /, ~, two '/', an existing parent folder) and is no folder: "no such
    folder", in train.py and evaluate.py, online or not (before: "no network ... set HF_HUB_OFFLINE=1", and offline
    "Repo id must be in the form"); only a hub id gets the network message."""
    typo = ".cache/models/tiny-qwen25_vl"
    one_line_error(train_cli[1]["no such folder"], f"model: no such folder: {typo}")
    import evaluate  # in this process: common.cli's one line is the train.py run's above

    with pytest.raises(common.UserError, match=f"model: no such folder: {typo}$"):
        evaluate.main(evaluate.load_config(["--model", typo, "--benchmarks", "nope"]))
    from huggingface_hub import constants

    for path in ("./m", "../m", "/m", "~/m", "a/b/c", "tests/m"):
        with pytest.raises(common.UserError, match=f"no such folder: {path}$"):
            common.check_hub(path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", OFFLINE_HUB["HF_ENDPOINT"])
    with pytest.raises(common.UserError, match="Qwen/Nope: no network"):
        common.check_hub("Qwen/Nope")


@pytest.mark.slow
def test_a_user_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """A YAML typo under 2-rank torchrun: rank 0 prints the one line, rank 1 nothing, exit 2, no rank's traceback;
    what follows is torchrun's own failure summary (its exit code 1), which no child can quiet (before: the line per
    rank). The issue's cases (typo, corrupt video, read-only folder, full disk) measured 41 or 42 lines in all."""
    typo = write(tmp_path, "typo.yaml", "lrr: 3\n")
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py"]
    p = run(*cmd, "--config", "configs/tiny_cpu.yaml", typo)
    out = (p.stdout + p.stderr).splitlines()
    assert out[0] == f"error: {typo}: unknown key 'lrr'", out[:5]
    assert sum(line.startswith("error: ") for line in out) == 1 and p.returncode == 1, out
    assert not any(line.startswith("[rank") for line in out), out
    root_cause = "\n".join(out).split("Root Cause")[
        1
    ]  # the first rank to exit (the other may be torchrun's kill)
    assert "exitcode  : 2" in root_cause, root_cause


def test_a_write_error_mid_run_names_the_step_and_the_file(tmp_path):
    """common.writing (train.py's metrics, samples and checkpoints): an OSError, or DCP's CheckpointException that
    every rank raises with every rank's failures, is a one-line user error naming the step and the file (before: a
    traceback per rank, "No space left on device" at line 53 of 192); the checkpoint's is printed by rank 0 alone."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(
        common.UserError, match=r"^step 3: cannot write .*metrics.jsonl: Is a direc"
    ):
        with common.writing(3, str(tmp_path)):
            open(tmp_path / "metrics.jsonl", "a")
    full = OSError(28, "No space left on device", "ckpt/step_00000004.tmp/__0_0.distcp")
    failures = {r: (full, traceback.StackSummary()) for r in (0, 1)}
    with pytest.raises(common.UserError) as e:
        with common.writing(4, str(tmp_path)):
            raise CheckpointException("save failed", failures)
    assert str(e.value) == f"step 4: cannot write {full.filename}: No space left on device"
    assert e.value.every_rank and common.users(full)


@two_rank_share
def own_config_run(tmp_path_factory) -> Share:
    """A run of conftest's shared 2-rank launch with its settings in its own YAML over the demo's (one step on the HF
    sampler, 3 held-out samples, the HF folder saved), for evaluate.py to read."""
    d = tmp_path_factory.mktemp("own_config")
    color = color_data_dir()
    layer = {
        "model": tiny_model_dir(),
        "train_data": f"{color}/train.jsonl",
        "val_data": f"{color}/val.jsonl",
        "cache_dir": str(d / "frames"),
        "rollout": "hf",
        "max_steps": 1,
        "group_size": 4,
        "prompts_per_step": 4,
        "eval_max_samples": 3,
    }
    (d / "run.yaml").write_text(json.dumps(layer))  # JSON is YAML
    configs = ["--config", "configs/tiny_cpu.yaml", str(d / "run.yaml")]
    return Share({"own config": [*configs, "--out-dir", str(d / "run")]})


@pytest.mark.slow
def test_evaluate_with_a_runs_own_config_gives_its_held_out_answers(two_rank, tmp_path, capsys):
    """evaluate.py --config <the run's configs> on its final folder: the training config's keys it does not use listed
    once, its held-out frame settings, answer length and sample count read (before: "unknown key 'train_data'"), so
    each held-out answer and the accuracy equal the in-training evaluation's; results.json records the settings."""
    import asyncio

    run = share_of(two_rank, __name__)["own config"]
    configs = ["configs/tiny_cpu.yaml", str(run.folder.parent / "run.yaml")]
    args = ["--model", str(run.folder / "final"), "--engine", "hf", "--out-dir", str(tmp_path)]
    cfg = evaluate.load_config(["--config", *configs, *args, "--data-dir", color_data_dir()])
    assert "not used: eval_every, group_size, lr, max_steps" in capsys.readouterr().err
    results = asyncio.run(evaluate.evaluate(cfg))
    trained = {
        r["doc_id"]: r["resps"] for r in map(json.loads, open(run.folder / "eval/step_1.jsonl"))
    }
    rows = [json.loads(line) for line in open(tmp_path / "nvr1" / "samples.jsonl")]
    assert {r["doc_id"]: r["resps"] for r in rows} == trained and len(trained) == 3
    assert results["nvr1"]["metrics"]["accuracy"] / 100 == run.rows[-1]["eval/accuracy"]
    settings = json.load(open(tmp_path / "results.json"))["settings"]
    frames = [
        settings[k] for k in ("video_fps", "video_max_frames", "video_max_pixels", "max_tokens")
    ]
    assert frames == [4.0, 8, 3136, 8], settings


def test_evaluate_reads_a_training_recipe_as_its_held_out_evaluation(tmp_path, capsys):
    """evaluate.load_config on the 7B recipe and a layer: the held-out frame settings (val_video_fps over
    video_fps), prompt format, answer length and sample count of the in-training evaluation, greedy, results in
    evaluate.py's own folder; the keys it does not use listed on one line; a key neither program knows fails."""
    layer = write(tmp_path, "val.yaml", "val_video_fps: 1.0\nbenchmarks: nvr1\n")
    cfg = evaluate.load_config(
        ["--config", "configs/qwen2_5_vl_7b.yaml", layer, "--max-samples", "5"]
    )
    read = [cfg.video_fps, cfg.video_max_frames, cfg.video_max_pixels, cfg.response_format]
    assert read == [1.0, 64, 262144, "think_answer"], cfg
    assert (cfg.max_tokens, cfg.max_samples, cfg.temperature, cfg.out_dir) == (2048, 5, 0.0, "")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "not used: clip_high, eval_every, " in err[0], err
    typo = write(tmp_path, "typo.yaml", "lrr: 1\n")
    with pytest.raises(common.UserError, match="typo.yaml: unknown key 'lrr'"):
        evaluate.load_config(["--config", "configs/tiny_cpu.yaml", typo])

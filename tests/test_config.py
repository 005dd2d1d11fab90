"""train.Config as a user meets it: choice fields reject typos (flags, YAML, code), YAML values are typed, every
combination is checked before anything loads, --dry-run, the prompt asks for the format the reward checks.

    .venv/bin/python -m pytest -q tests/test_config.py
"""

import dataclasses
import json
import os
import typing

import pytest
import yaml
from conftest import ROOT

import common
import data
import rewards
from train import Config, check_config, load_config, main

CHOICES = {
    "video_source",
    "no_audio",
    "rollout",
    "response_format",
    "adv_estimator",
    "loss_type",
    "loss_agg",
    "kl_type",
    "tis",
    "tis_mode",
    "dyn_filter_metric",
    "fsdp",
}


def write(tmp_path, text: str, name: str = "x.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_typo_in_every_choice_field_is_rejected(tmp_path, capsys):
    """`--rollout vLLM` once ran the HF generator and `--tis seq` token level: a typo in any choice field is now an
    error from the flag parser, from a YAML file (naming the file and key) and from check_config (Config in code)."""
    literal = {
        f.name for f in dataclasses.fields(Config) if typing.get_origin(f.type) is typing.Literal
    }
    assert literal == CHOICES
    for name in CHOICES:
        typo = getattr(Config(), name).upper() + "x"
        with pytest.raises(SystemExit):
            load_config([f"--{name.replace('_', '-')}", typo])
        assert "invalid choice" in capsys.readouterr().err.lower()
        with pytest.raises(ValueError, match=f"x.yaml: {name}: '{typo}' is not "):
            load_config(["--config", write(tmp_path, f"{name}: {typo}\n")])
        with pytest.raises(ValueError, match=f"{name}: '{typo}' is not "):
            check_config(Config(**{name: typo}))
    assert (
        load_config(["--tis", "sequence", "--tis-mode", "mask", "--rollout", "hf"]).tis
        == "sequence"
    )


def test_yaml_values_are_typed(tmp_path):
    """PyYAML reads `1e-6` as a string (YAML 1.1 wants `1.0e-6`): a float field takes it as the number; a value that
    is not of the field's type is an error naming the file and the key."""
    cfg = load_config(
        ["--config", write(tmp_path, "lr: 1e-6\nclip_high: 1\ntis: token\nrollout: hf\n")]
    )
    assert (cfg.lr, cfg.clip_high, cfg.tis, cfg.rollout) == (1e-6, 1.0, "token", "hf")
    assert type(cfg.lr) is float and type(cfg.clip_high) is float
    for text, key in (
        ("lr: abc", "lr"),
        ("group_size: 2.5", "group_size"),
        ("group_size: '8'", "group_size"),
        ("mix_offline: 'yes'", "mix_offline"),
        ("model: 7", "model"),
        ("save: 1", "save"),
        ("kl_coef: [0.1]", "kl_coef"),
    ):
        with pytest.raises(ValueError, match=f"x.yaml: {key}: "):
            load_config(["--config", write(tmp_path, text + "\n")])
    with pytest.raises(ValueError, match="y.yaml: unknown key 'learning_rate'"):
        load_config(
            [
                "--config",
                write(tmp_path, "lr: 1e-6\n"),
                write(tmp_path, "learning_rate: 1\n", "y.yaml"),
            ]
        )
    # a flag after the files still overrides them
    assert load_config(["--config", write(tmp_path, "lr: 1e-6\n"), "--lr", "2e-6"]).lr == 2e-6


def test_config_flag_is_in_help(capsys):
    with pytest.raises(SystemExit):
        load_config(["--help"])
    out = capsys.readouterr().out
    assert "--config" in out and "YAML files" in out and "--dry-run" in out and "--world" in out
    assert "--debug: an error's traceback" in out  # common.cli's flag, before the parser


def test_check_config_reports_every_bad_combination(monkeypatch):
    """All problems in one error, each naming its fields; the shipped configs pass on their world sizes (the hour
    recipes with VLLM_ALLOW_LONG_MAX_MODEL_LEN, as their launch lines: vLLM's own checks run in check_config)."""
    cfg = Config(
        prompts_per_step=6,
        group_size=2,
        mini_batches=4,
        lr=0.0,
        kl_in_reward=True,
        kl_coef=0.0,
        rollout="hf",
        rollout_tp=2,
        mix_offline=False,
        mix_threshold=0.5,
        overlong_buffer=100,
        max_response_len=64,
        video_min_frames=40,
        video_max_frames=8,
        gpu_memory_utilization=1.5,
        video_source="cache_only",
        cache_dir="",
        min_lr_ratio=2.0,
        resume="no/such/dir",
        warmup_steps=-1,
    )
    with pytest.raises(ValueError) as e:
        check_config(cfg, world=4)
    lines = str(e.value).splitlines()[1:]
    expected = [
        "lr must be > 0",
        "warmup_steps must be >= 0",
        "prompts_per_step 6 % data-parallel size 4 != 0",
        "rollout_tp > 1 needs rollout vllm",
        "mini_batches 4 > 2 rollouts per rank and step",
        "min_lr_ratio 2.0 must be in [0, 1]",
        "gpu_memory_utilization 1.5 must be <= 1",
        "mix_threshold needs mix_offline",
        "overlong_buffer 100 must be <= 1",
        "video_min_frames > video_max_frames",
        "video_source cache_only needs a cache_dir",
        "kl_in_reward needs kl_coef > 0",
        "resume 'no/such/dir': no such folder",
    ]
    assert len(lines) == len(expected) and all(
        line.strip().startswith(x) for line, x in zip(lines, expected)
    ), lines
    with pytest.raises(ValueError, match="gdpo's reward components carry no KL"):
        check_config(Config(kl_in_reward=True, kl_coef=0.1, adv_estimator="gdpo"))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    for name in [f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml")]:
        world = 8 if name.startswith("qwen") else 2
        # as `train.py --dry-run --world N` checks it: offload's CUDA is the launch's, not this machine's
        check_config(
            dataclasses.replace(load_config(["--config", *recipe(name)]), world=world), world
        )


def recipe(name: str) -> list[str]:
    """configs/<name> after the base it names if it is a layer (memory_plan.layer_base)."""
    from memory_plan import layer_base

    path = os.path.join(ROOT, "configs", name)
    return [base for base in [layer_base(path)] if base] + [path]


def test_gpu_recipes_checkpoint_every_few_minutes_of_work():
    """Every GPU recipe (layers over their base) saves on a schedule and keeps its last checkpoints; each sets both
    itself, with its reason, but a layer whose base's step it keeps (before: the 7B/8B, LoRA and hour-long recipes
    saved only on a signal: a crash at hour five lost the run)."""
    names = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.startswith("qwen"))
    assert len(names) == 11, names
    for name in names:
        cfg = load_config(["--config", *recipe(name)])
        assert cfg.save_every > 0 and cfg.keep_last > 0, name
        own = yaml.safe_load(open(os.path.join(ROOT, "configs", name)))
        assert name == "qwen2_vl_7b.yaml" or {"save_every", "keep_last"} <= set(own), name


def test_prompt_asks_for_the_rewarded_format():
    """One setting, response_format, writes the instruction of every default template and picks the format reward:
    the think_answer configs ask for <think>, the others do not."""
    sample = {
        "id": "s",
        "problem": "Which?",
        "answer": "B",
        "problem_type": "multiple choice",
        "options": ["A. x"],
    }
    plain, think = (
        data.render_prompt(sample),
        data.render_prompt(sample, response_format="think_answer"),
    )
    assert plain.endswith("<answer> </answer> tags.") and "<think>" not in plain
    assert "inside <think> </think> tags, then" in think and think.endswith(
        "<answer> </answer> tags."
    )
    for ptype in data.TEMPLATES:
        rendered = data.render_prompt(
            dict(sample, problem_type=ptype), response_format="think_answer"
        )
        assert data.INSTRUCTIONS["think_answer"] in rendered, ptype
    assert (
        data.render_prompt(sample, "{{ problem }} {{ instruction }}")
        == "Which? " + data.INSTRUCTIONS["answer"]
    )
    for name in ("qwen2_5_vl_7b", "qwen3_vl_8b"):
        assert (
            load_config(["--config", os.path.join(ROOT, f"configs/{name}.yaml")]).response_format
            == "think_answer"
        )
    good = "<think>the car is blue</think><answer>B</answer>"
    assert rewards.compute_reward(good, sample, format_template="think_answer")[1]["format"] == 1.0
    assert (
        rewards.compute_reward("<answer>B</answer>", sample, format_template="think_answer")[1][
            "format"
        ]
        == 0.0
    )


def test_dry_run_prints_config_counts_and_longest_prompt(tmp_path, tiny_model, capsys):
    """--dry-run: the resolved config (a YAML that --config reads back), the sample counts and the processor-expanded
    length of the longest prompt; it exits before any model loads (no run folder content) and returns None."""
    import make_synthetic_data
    from transformers import AutoProcessor

    src = str(tmp_path / "data")
    make_synthetic_data.make(
        src, ["color"], num_train=5, num_val=3, seed=0, size=56, fps=4, seconds=2.0
    )
    with open(f"{src}/train.jsonl", "a") as f:  # the longest: a longer question over the same video
        first = json.loads(open(f"{src}/train.jsonl").readline())
        f.write(
            json.dumps(dict(first, id="long", problem=first["problem"] + " Look closely." * 20))
            + "\n"
        )
    out = tmp_path / "run"
    cfg = load_config(
        [
            "--config",
            os.path.join(ROOT, "configs/tiny_cpu.yaml"),
            "--model",
            tiny_model,
            "--train-data",
            f"{src}/train.jsonl",
            "--val-data",
            f"{src}/val.jsonl",
            "--out-dir",
            str(out),
            "--cache-dir",
            "",
            "--video-source",
            "decode_only",
            "--dry-run",
        ]
    )
    assert main(cfg) is None
    printed = capsys.readouterr().out
    resolved = printed.split("\ndata: ")[0]
    assert (
        yaml.safe_load(resolved)["lr"] == 0.001
        and yaml.safe_load(resolved)["train_data"] == f"{src}/train.jsonl"
    )
    path = write(tmp_path, resolved, "resolved.yaml")  # read back, it is the same run
    assert load_config(["--config", path]) == dataclasses.replace(
        cfg, config=(path,), dry_run=False
    )
    assert "data: 6 train, 3 val, 0 skipped" in printed
    # by definition: the chat-templated text with one <|video_pad|> per merged patch: 8 frames of 56x56 -> grid
    # (4, 4, 4) -> 64 patches / 2x2 merge = 16 video tokens
    proc = AutoProcessor.from_pretrained(tiny_model)
    long = dict(first, problem=first["problem"] + " Look closely." * 20, videos=["v"])
    text = proc.apply_chat_template(
        data.chat_messages(long, data.render_prompt(long)),
        tokenize=False,
        add_generation_prompt=True,
    )
    n = len(proc.tokenizer(text.replace("<|video_pad|>", "<|video_pad|>" * 16)).input_ids)
    assert f"train: longest prompt {n} tokens (sample long, max_prompt_len 1024)" in printed
    assert not out.exists() or not os.listdir(out)


def test_cache_cli_reads_the_training_config(tmp_path, tiny_model):
    """`cache_frames.py --config train.yaml` takes the data files, cache folder, frame settings and the model's factor
    from the training config (flags after it override), and its entries are the ones training reads."""
    import cache
    import cache_frames
    import make_synthetic_data

    src = str(tmp_path / "data")
    make_synthetic_data.make(
        src, ["color"], num_train=2, num_val=1, seed=0, size=56, fps=4, seconds=2.0
    )
    run = {
        "model": tiny_model,
        "train_data": f"{src}/train.jsonl",
        "val_data": f"{src}/val.jsonl",
        "cache_dir": str(tmp_path / "frames"),
        "video_fps": 2.0,
        "video_min_frames": 2,
        "video_max_frames": 6,
        "video_min_pixels": 3136,
        "video_max_pixels": 3136,
        "video_total_pixels": 0,
    }
    path = write(tmp_path, yaml.safe_dump(run), "run.yaml")
    c = cache_frames.load_config(["--config", path, "--workers", "1"])
    assert (c.data, c.out, c.factor, c.workers) == (
        [run["train_data"], run["val_data"]],
        run["cache_dir"],
        28,
        1,
    )
    assert (
        c.video_fps,
        c.video_min_frames,
        c.video_max_frames,
        c.video_min_pixels,
        c.video_max_pixels,
    ) == (2.0, 2, 6, 3136, 3136)
    assert (
        cache_frames.load_config(["--config", path, "--video-max-frames", "4"]).video_max_frames
        == 4
    )
    # a held-out frame budget of its own (val_*): the held-out file is not cached with training's settings
    other = write(tmp_path, yaml.safe_dump(dict(run, val_video_max_frames=4)), "val4.yaml")
    assert cache_frames.load_config(["--config", other]).data == [run["train_data"]]
    assert cache_frames.preprocess(c)["decode"] == 3
    cfg = load_config(["--config", path])
    sample = data.load_samples(cfg.train_data)[0]
    stats = {}
    cache.load_video(sample["videos"][0], cfg, 28, cfg.cache_dir, mode="cache_only", stats=stats)
    assert stats["cache_hit"] == 1


@pytest.mark.slow  # a DCP save and load of the tiny model, and two model loads
def test_export_bfloat16(tmp_path, tiny_model, monkeypatch, capsys):
    """scripts/export_hf.py --dtype bfloat16: every saved tensor is bf16 and equals the checkpoint's fp32 tensor
    rounded to bf16; config.json says so. The checkpoint: the tiny model as torch.distributed.checkpoint shards next
    to its config and processor files (what ckpt.save writes). The script runs as a command line in this process
    (runpy: its imports are this process's already; a subprocess took ~14 CPU s)."""
    import runpy
    import shutil
    import sys

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    step = tmp_path / "step_1"
    shutil.copytree(tiny_model, step, ignore=shutil.ignore_patterns("*.safetensors*"))
    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step))
    (step / "meta.json").write_text(
        json.dumps({"config": {"model": tiny_model}})
    )  # as ckpt.save writes it
    argv = ["export_hf.py", str(step), str(tmp_path / "hf"), "--dtype", "bfloat16"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(os.path.join(ROOT, "scripts", "export_hf.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'hf'}: ") and "config.json" in out, out
    saved = {
        k: v
        for f in os.listdir(tmp_path / "hf")
        if f.endswith(".safetensors")
        for k, v in load_file(str(tmp_path / "hf" / f)).items()
    }
    assert len(saved) == len(model.state_dict()) and all(
        v.dtype == torch.bfloat16 for v in saved.values()
    )
    exported = AutoModelForImageTextToText.from_pretrained(
        str(tmp_path / "hf"), dtype="auto"
    ).state_dict()
    assert exported.keys() == model.state_dict().keys()
    assert all(
        torch.equal(exported[k], v.to(torch.bfloat16)) for k, v in model.state_dict().items()
    )
    assert json.load(open(tmp_path / "hf" / "config.json"))["dtype"] == "bfloat16"


def test_curve_keeps_the_steps_before_a_resume(tmp_path):
    """curve.png is drawn from metrics.jsonl, not from this process's rows: a run that crashed after step 3 and
    resumed from its step-1 checkpoint logged steps 1, 2, 3, 2, 3, 4; the curve has 0..4, steps 2 and 3 as re-run."""
    from common import curve_rows

    logged = [1, 2, 3, 2, 3, 4]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, step in enumerate(logged):
            f.write(
                json.dumps({"step": step, "reward/mean": i / 10, "reward/accuracy": 0.0}) + "\n"
            )
    rows = curve_rows(str(tmp_path / "metrics.jsonl"), acc_before=0.25)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["reward/mean"] for r in rows[1:]] == [0.0, 0.3, 0.4, 0.5] and rows[0][
        "eval/accuracy"
    ] == 0.25


@pytest.mark.parametrize("mode", ["disabled", "offline"])
def test_wandb_follows_wandb_mode(tmp_path, monkeypatch, mode):
    """wandb is no longer forced offline without WANDB_API_KEY: WANDB_MODE decides (disabled writes nothing at all);
    an offline run holds the samples table that write_samples logs next to samples.jsonl."""
    import glob

    import wandb

    from train import start_logs, write_samples

    wandb.teardown()  # wandb reads WANDB_MODE once per process, at its first init: a fresh start, as a new run has
    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = Config(wandb_project="nvr1-test", out_dir=str(tmp_path))
    logger = start_logs(cfg, {}, [], rank=0)
    shown = [
        {
            "step": 1,
            "id": "s1",
            "response": "<answer>B</answer>",
            "finish": "stop",
            "reward": {"overall": 1.0, "accuracy": 1.0, "format": 1.0},
            "advantage": 0.5,
        }
    ]
    write_samples(shown, cfg, logger, step=1)
    logger.finish()
    assert [json.loads(line) for line in open(tmp_path / "samples.jsonl")] == shown
    tables = glob.glob(
        str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "table" / "samples_*.json")
    )
    if mode == "disabled":
        assert not glob.glob(str(tmp_path / "wandb" / "*run-*"))
    else:
        table = json.load(open(tables[0]))
        assert table["columns"] == list(shown[0]) and table["data"][0][2] == "<answer>B</answer>"
        assert json.loads(table["data"][0][4]) == shown[0]["reward"]
    assert start_logs(cfg, {}, [], rank=1).id is None  # other ranks never start a run


def test_media_settings_and_the_held_out_budget():
    """Config.media: the cache.Media data.prepare reads (not the whole Config); held_out: each val_* field that is set
    replaces its training field, the unset ones (0) keep training's."""
    import cache

    cfg = Config(
        video_max_frames=8, val_video_max_frames=4, val_image_max_pixels=5000, cache_dir="c"
    )
    train_media = cfg.media()
    held_out = cfg.media(held_out=True)
    assert type(train_media) is cache.Media and type(held_out) is cache.Media
    assert (train_media.video_max_frames, train_media.image_max_pixels) == (8, 1003520)
    assert (held_out.video_max_frames, held_out.image_max_pixels) == (4, 5000)
    assert held_out.video_fps == cfg.video_fps and held_out.cache_dir == "c"


def test_field_facts_sit_beside_their_fields():
    """The bounds, the resume rule and the choices are read from the fields themselves (no name lists): a bound on a
    field of cache.Media (video_fps) is checked like one of train.Config's; a field MAY_CHANGE_ON_RESUME is the
    resume rule's."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert (
        fields["video_fps"].metadata["bound"] == "> 0" and "resume" in fields["max_steps"].metadata
    )
    assert "resume" not in fields["lr"].metadata and "resume" in fields["cache_dir"].metadata
    with pytest.raises(ValueError) as e:
        check_config(Config(video_fps=0.0, keep_last=-1, lr=float("nan"), tis="seq"))
    assert str(e.value).splitlines()[1:] == [
        "  video_fps must be > 0, got 0.0",
        "  tis: 'seq' is not '' | 'token' | 'sequence'",
        "  lr must be finite, got nan",
        "  keep_last must be >= 0, got -1",
    ], str(e.value)
    # a zero the combinations divide by is the field's error, not a ZeroDivisionError
    with pytest.raises(ValueError, match="rollout_tp must be > 0, got 0"):
        check_config(Config(rollout_tp=0, sp_size=2), world=2)


def test_dry_run_checks_a_recipe_for_the_world_it_names(tmp_path, color_data, capsys, monkeypatch):
    """--dry-run --world 8: the hour-long 7B recipe (sp 8, rollout_tp 4) is checked for 8 ranks in one CPU process
    (before: "world size 1 % rollout_tp 4 != 0"); a model of the 7B's heads (28 query, 4 KV) stands in for vLLM's
    checks. --world outside a dry run is refused."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    import make_tiny_model

    # built here too: a fresh clone may run this before the rehearsal that also builds it
    model = make_tiny_model.ensure(
        "qwen2_5_vl", os.path.join(ROOT, ".cache/models"), variant="heads28-4"
    )
    argv = ["--config", *recipe("qwen2_5_vl_7b_long.yaml"), "--dry-run", "--model", model]
    argv += ["--train-data", f"{color_data}/train.jsonl", "--val-data", f"{color_data}/val.jsonl"]
    argv += ["--out-dir", str(tmp_path / "run")]
    with pytest.raises(common.UserError, match="world size 1 % rollout_tp 4 != 0"):
        main(load_config(argv))
    assert main(load_config([*argv, "--world", "8"])) is None
    out = capsys.readouterr().out
    assert "sp_size: 8\n" in out and "data: 16 train, 4 val, 0 skipped" in out, out[-2000:]
    with pytest.raises(common.UserError, match="world 8 is --dry-run's"):
        main(load_config([*argv[:3], *argv[4:], "--world", "8"]))

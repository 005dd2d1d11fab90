"""Sequence parallelism (sp.py, issue 14): sp_size ranks hold the shards of the same rows and compute what one
process computes on the whole rows. The torchrun workers are this file run as a script:

    torchrun --nproc_per_node=2 tests/test_sp.py OUT DATA.jsonl 2 - qwen2_vl qwen2_5_vl qwen3_vl   # sp 2
    torchrun --nproc_per_node=4 tests/test_sp.py OUT DATA.jsonl 2 ckpt qwen3_vl             # dp 2 x sp 2, checkpointing
    torchrun --nproc_per_node=4 tests/test_sp.py OUT DATA.jsonl 4 - qwen3_vl-wide           # sp 4: 6 heads padded to 8

The tests run it through tests/train_worker.py, the configurations of one world size in one launch (the 2-rank one
with sp_train's train.py runs).

    .venv/bin/python -m pytest -q tests/test_sp.py
"""

import os
import sys

import pytest
from dataclasses import replace
import torch

sys.path[:0] = [
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(os.path.abspath(__file__)),
]
import data  # noqa: E402
import train  # noqa: E402
from conftest import (  # noqa: E402
    ROOT,
    background,
    global_counts,
    lane_result,
    synth_dir,
    tiny_config,
)
from rollout import Rollout, vision_token_ids  # noqa: E402

TEMPERATURE, CHUNK = 0.7, 3
# all rows; image+video x 2 and text (the video split mid-way over 2 ranks); image+video alone (twice, for dp 2): no
# padding, so no mask, the kernel's causal mode
BATCHES = [list(range(7)), [4, 5, 6], [4, 4]]
# one sp2 launch runs them all: ~10 CPU s of startup shared. Qwen3-VL-MoE stands for the MoE families (Qwen3.5-MoE's
# experts are the same FSDP2 unit, a decoder layer); Qwen3.5's linear attention is refused with sp_size > 1
ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def model_dir(name: str) -> str:
    """name: an arch, or arch-variant (make_tiny_model.VARIANTS: "qwen3_vl-wide")."""
    import make_tiny_model

    arch, _, variant = name.partition("-")
    return make_tiny_model.ensure(arch, root=os.path.join(ROOT, ".cache/models"), variant=variant)


def make_rows(processor, cfg, data_path: str, layout=None, stats: dict | None = None) -> list:
    """7 rows: a video prompt x 2, an image prompt x 2, image+video x 2, text x 1; the longest prompt plus the longest
    response is odd (the sequence does not split evenly over 2 ranks: the last shard holds a padding position). SP
    (layout): SP rank k % sp_size prepares prompt k (its decodes counted in `stats`) and sp.group_runs leaves each
    rank its run of every prompt's pixel rows, as in train.sample_batch."""
    import sp

    samples = data.load_samples(data_path)
    video = next(s for s in samples if s.get("videos"))
    image = next(s for s in samples if s.get("images"))
    both = dict(video, id="both", images=image["images"], data_type="video")
    text = dict(video, id="text", videos=[], data_type="text")
    samples, (r, n) = (
        (video, image, both, text),
        (layout.sp_rank, layout.sp_size) if layout else (0, 1),
    )
    order = [
        k for q in range(n) for k in range(q, 4, n)
    ]  # rank q prepares prompts q, q + n, ...: Layout.share's
    prompts = [
        data.prepare(samples[k], processor, cfg, stats) if k % n == r else None for k in order
    ]
    if n > 1:  # a rollout of each prompt prepared here, to the SP group
        own = [Rollout(p, [], None, "", "stop") for p in prompts if p is not None]
        group = sp.group_runs(prompts, layout)
        prompts = [x.prompt for x in sp.group_rollouts(own, [0.0] * len(own), group, 1, layout)[0]]
    prompts = [prompts[order.index(k)] for k in range(4)]
    longest = (
        5 - max(len(p.prompt_ids) for p in prompts) % 2
    )  # 4 or 5 response tokens: an odd total
    responses = [
        [30, 31, 32],
        [40],
        [50, 51],
        list(range(60, 60 + longest)),
        [70, 71],
        [],
        [80, 81],
    ]
    return [
        Rollout(prompts[k], ids, None, "", "stop")
        for k, ids in zip([0, 0, 1, 1, 2, 2, 3], responses)
    ]


def run(
    arch: str,
    data_path: str,
    sp_size: int,
    layout,
    checkpointing: bool = False,
    device: str = "cpu",
    kernel: str = "",
    once: bool = False,
) -> dict:
    """Per batch of BATCHES: this dp rank's rows (dp ranks take them round-robin), their log-probs and entropy, and
    the loss of train.micro_loss with conftest.global_counts' normalizers (per-row advantages, an entropy bonus,
    seq-mean-token-mean: every token weighs differently); every parameter's full gradient of the summed losses.
    kernel: the decoder's attention kernel instead of load_model's choice (the CUDA tests: sdpa or flash-attn).
    once (train.update's path): the batches as one mini-batch's micro-batches, each prompt through the tower once
    with gradient (sp.Towers: dp 1 at its first batch, else all at the first), its feature gradient summed over
    its batches and taken through the tower once; the no-grad log-probs from features kept per sample
    (sp.FeatureCache, the reference's path); encodes{k}: the cache's encodes."""
    import sp
    from transformers import AutoProcessor

    d = model_dir(arch)
    cfg = tiny_config(
        model=d,
        sp_size=sp_size,
        temperature=TEMPERATURE,
        logp_chunk=CHUNK,
        entropy_coef=0.1,
        loss_agg="seq-mean-token-mean",
        gradient_checkpointing=checkpointing,
    )
    processor = AutoProcessor.from_pretrained(d)
    tok = processor.tokenizer
    banned = vision_token_ids(tok)
    stats = {"decode": 0}
    rows = make_rows(processor, cfg, data_path, layout, stats)
    model = train.load_model(cfg, torch.device(device))
    if kernel:
        sp.language_model(model).config._attn_implementation = kernel
        if sp_size > 1:
            sp.use_ulysses(model)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    dummies = data.dummy_prompts(processor) if world > 1 else None
    dp_rank, dp_size = (layout.dp_rank, layout.dp_size) if layout else (0, 1)
    prompts = list({id(r.prompt): r.prompt for r in rows}.values())
    out = {
        "decodes": torch.tensor(stats["decode"])
    } | {  # each rank's own pixel rows (the reference: all)
        pixels: torch.cat([p.mm[pixels] for p in prompts if pixels in p.mm])
        for _, pixels, _ in sp.MEDIA
    }
    if once:
        mini = [[rows[i].prompt for i in batch[dp_rank::dp_size]] for batch in BATCHES]
        towers = sp.Towers(model, mini, device, layout, dummies)
        kept = sp.FeatureCache()
    for k, batch in enumerate(BATCHES):
        index = batch[dp_rank::dp_size]
        b = train.collate([rows[i] for i in index], tok.pad_token_id, device, dummies)
        with torch.no_grad():
            counts = train.Counts()
            if once:
                b.vision = kept.vision(model, b.prompts, device, layout, dummies)
                counts.encodes = b.vision.encodes
            logp, ent = train.token_logp(model, b, TEMPERATURE, banned, CHUNK, layout, counts)
        if once:
            b.vision = towers.vision(k)
        b.adv = (
            0.3 * torch.tensor(index, dtype=torch.float32, device=device)[:, None] - 1.0
        ).expand_as(b.mask)
        b.n_tok, b.n_seq = (n / sp_size for n in global_counts([b]))  # as train.main: each row once
        loss, metrics = train.micro_loss(model, b, cfg, banned, layout)
        (loss * world).backward()  # FSDP averages over ranks: x world, a sum
        if once:
            towers.backward(k)
        out.update(
            {
                f"logp{k}": logp * b.mask,
                f"ent{k}": ent * b.mask,
                f"index{k}": torch.tensor(index),
                f"encodes{k}": torch.tensor(counts.encodes),
                f"length{k}": torch.tensor(b.input_ids.shape[1]),
                f"loss{k}": torch.tensor(metrics["loss"], dtype=torch.float64),
            }
        )
    for n, p in model.named_parameters():  # full_tensor is a collective: every rank calls it
        out["grad." + n] = (
            p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        ).contiguous()
    return out


def exchange_sizes(rank: int, world: int) -> tuple[list[int], list[int]]:
    """all_to_all's uneven test split: rank r sends 1 + (r + 2j) % 3 rows to rank j (and receives what j sends it)."""
    return [1 + (rank + 2 * j) % 3 for j in range(world)], [
        1 + (j + 2 * rank) % 3 for j in range(world)
    ]


def exchange_grad(rank: int, world: int, group) -> torch.Tensor:
    """d/dx of sum_r <sp.AllToAll(x_r), w_r>, summed over the ranks, for this rank's x (float64, seeded by rank)."""
    import sp

    send, recv = exchange_sizes(rank, world)
    x = torch.randn(
        sum(send), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)
    )
    w = torch.randn(
        sum(recv), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank)
    )
    x.requires_grad_(True)
    (sp.AllToAll.apply(x, group, send, recv) * w).sum().backward()
    return x.grad


def worker(out_dir: str, data_path: str, sp_size: str, mode: str, *archs: str):
    """mode: "-", "ckpt" (activation checkpointing) or "cuda-<kernel>" (on the GPUs, also the rows without SP)."""
    from safetensors.torch import save_file

    import sp

    rank, world, device = train.init_dist()
    layout = sp.make_layout(int(sp_size))
    if not mode.startswith("cuda-"):
        save_file(
            {"grad": exchange_grad(rank, world, None)},
            os.path.join(out_dir, f"exchange.rank{rank}.safetensors"),
        )
    for arch in archs:
        if mode.startswith("cuda-"):
            kernel = mode.removeprefix("cuda-")
            result = run(arch, data_path, int(sp_size), layout, device=str(device), kernel=kernel)
            plain = run(arch, data_path, 1, None, device=str(device), kernel=kernel)
            result = {k: v.cpu() for k, v in result.items()} | {
                f"plain.{k}": v.cpu() for k, v in plain.items()
            }
        else:
            result = run(arch, data_path, int(sp_size), layout, mode == "ckpt", once=True)
        save_file(result, os.path.join(out_dir, f"{arch}.rank{rank}.safetensors"))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def reference(synth):
    """Every checkpoint, one process, the whole rows: what every SP run must reproduce."""
    return {arch: run(arch, os.path.join(synth, "train.jsonl"), 1, None) for arch in ARCHS}


# The SP configurations, fixture -> (ranks, sp_size, mode, checkpoints): the worker's arguments. They run in
# conftest's background lane, those of one world size in one torchrun launch (tests/train_worker.py: torchrun's start
# and every rank's imports, ~7 CPU s a rank, paid once); each fixture returns its folder (every rank's safetensors)
CONFIGS = {
    "sp2_ranks": (2, "2", "-", *ARCHS),
    "dp2_ranks": (2, "1", "-", "qwen3_5"),  # linear attention: sp 1
    "dp2_sp2_ranks": (4, "2", "ckpt", "qwen3_vl"),
    "sp3_wide_ranks": (3, "3", "-", "qwen2_5_vl-wide"),
    "sp4_wide_ranks": (4, "4", "-", "qwen2_5_vl-wide", "qwen3_vl-wide"),
}


def worker_run(out, name: str) -> list[str]:
    """train_worker's run of the SP configuration `name` into out / name; its checkpoints are built here, once (not
    by the ranks at the same time)."""
    _, sp_size, mode, *archs = CONFIGS[name]
    for arch in archs:
        model_dir(arch)
    (out / name).mkdir()
    return [
        "tests/test_sp.py",
        str(out / name),
        os.path.join(synth_dir(), "train.jsonl"),
        sp_size,
        mode,
        *archs,
    ]


def sp_launch(job: str, names: tuple):
    """The background job `job`: the configurations `names` (of one world size) in one launch. Returns (its folder,
    train_worker.Launch)."""

    @background(job)
    def prepare(tmp_path_factory):
        from train_worker import start

        out = tmp_path_factory.mktemp(job)
        runs = [worker_run(out, name) for name in names]

        def launch():
            return out, start(runs, nproc=CONFIGS[names[0]][0], timeout=600)

        return launch

    return prepare


sp_launch("launch_3_ranks", ("sp3_wide_ranks",))
sp_launch("launch_4_ranks", ("dp2_sp2_ranks", "sp4_wide_ranks"))


def config_fixture(name: str, job: str, k: int):
    """The fixture `name`: the folder of run k of the background job `job` (its failure: that run's output)."""

    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory):
        out, result = lane_result(job, tmp_path_factory)
        result.log(k)
        return out / name

    return fixture


sp2_ranks = config_fixture(
    "sp2_ranks", "launch_2_ranks", 0
)  # with train.py's runs: two_rank_launch
dp2_ranks = config_fixture("dp2_ranks", "launch_2_ranks", 1)
dp2_sp2_ranks = config_fixture("dp2_sp2_ranks", "launch_4_ranks", 0)
sp4_wide_ranks = config_fixture("sp4_wide_ranks", "launch_4_ranks", 1)
sp3_wide_ranks = config_fixture("sp3_wide_ranks", "launch_3_ranks", 0)


def check_against(ref: dict, got: list[dict], sp_size: int):
    """Every rank's log-probs/entropy equal the reference rows (fp32, 1e-5); the losses of one rank per SP group add
    up to the reference loss; rank 0's gradients equal the reference."""
    assert (
        ref["length0"] % 2 == 1
    )  # the first batch's sequence is odd: it does not split evenly over 2 ranks
    for k in range(len(BATCHES)):
        torch.testing.assert_close(
            sum(part[f"loss{k}"] for part in got[::sp_size]), ref[f"loss{k}"], rtol=1e-6, atol=0
        )
        for part in got:
            rows = [BATCHES[k].index(i) for i in part[f"index{k}"].tolist()]
            for key in (f"logp{k}", f"ent{k}"):
                want = ref[key][rows][:, : part[key].shape[1]]
                torch.testing.assert_close(part[key], want, rtol=0, atol=1e-5)
    grads = {n: t for n, t in ref.items() if n.startswith("grad.")}
    assert grads.keys() == {n for n in got[0] if n.startswith("grad.")}
    assert any(
        n.startswith("grad.model.visual.blocks") and g.abs().sum() > 0 for n, g in grads.items()
    )
    for n, g in grads.items():
        torch.testing.assert_close(got[0][n], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=n)


@pytest.mark.slow
@pytest.mark.lane("launch_2_ranks")  # the lane queues the jobs of tests' markers, not fixtures'
@pytest.mark.parametrize("arch", ARCHS)
def test_sp2_matches_one_process(sp2_ranks, reference, synth, arch):
    """sp_size 2 on 2 ranks vs one process, every checkpoint: log-probs, entropy and every parameter's gradient
    (fp32). Each video is decoded once per SP group, by the rank that prepares its prompt; each rank holds only its
    run of every prompt's pixel rows (bit for bit sp.run_rows of the whole prompt's) and encodes it: half of each
    video's temporal patches, the one-patch images on rank 1 (rank 0 encodes a dummy image: FSDP2 in step)."""
    from safetensors.torch import load_file
    from transformers import AutoProcessor

    import sp

    ref = reference[arch]
    got = [load_file(sp2_ranks / f"{arch}.rank{r}.safetensors") for r in range(2)]
    check_against(ref, got, 2)
    # the 2 videos (prompts 0 and 2: SP rank 0 prepares them) once, not once per rank
    assert ref["decodes"] == 2 and [part["decodes"] for part in got] == [2, 0]
    rows = make_rows(
        AutoProcessor.from_pretrained(model_dir(arch)),
        tiny_config(model=model_dir(arch)),
        os.path.join(synth, "train.jsonl"),
    )
    prompts = list({id(x.prompt): x.prompt for x in rows}.values())
    for _, pixels, grid in sp.MEDIA:
        assert sum(len(part[pixels]) for part in got) == len(ref[pixels])
        for r, part in enumerate(got):
            assert torch.equal(
                part[pixels],
                torch.cat([sp.run_rows(p, pixels, grid, r, 2) for p in prompts if pixels in p.mm]),
            )
    assert ref["encodes0"] == 4 and ref["encodes1"] == 2  # one process: 2 images + 2 videos; 1 + 1
    # train.update's path (once): the no-grad batches' features kept, the tower run for batch 0 alone
    assert [[part[f"encodes{k}"] for k in range(2)] for part in got] == [[3, 0], [4, 0]]


@pytest.mark.slow
@pytest.mark.lane("launch_2_ranks")
def test_qwen3_5_fsdp2_matches_one_process(dp2_ranks, synth):
    """Qwen3.5 (sp 1: its gated delta-net layers refuse SP) on 2 FSDP2 ranks, each half of the rows, vs one process:
    log-probs, entropy, the losses and every parameter's gradient (the gated delta-net's too)."""
    from safetensors.torch import load_file

    got = [load_file(dp2_ranks / f"qwen3_5.rank{r}.safetensors") for r in range(2)]
    assert any(".linear_attn." in n for n in got[0])
    check_against(run("qwen3_5", os.path.join(synth, "train.jsonl"), 1, None), got, 1)


@pytest.mark.slow
@pytest.mark.lane("launch_4_ranks")
def test_dp2_sp2_matches_one_process(dp2_sp2_ranks, reference):
    """4 ranks, dp 2 x sp 2 with activation checkpointing (the reference without): each SP pair takes half of the
    rows; the pair's log-probs equal the reference rows and the gradient equals one process over all rows (Qwen3-VL:
    deepstack features sliced to the shards; the recomputed attention is Ulysses again)."""
    from safetensors.torch import load_file

    got = [load_file(dp2_sp2_ranks / f"qwen3_vl.rank{r}.safetensors") for r in range(4)]
    check_against(reference["qwen3_vl"], got, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch",
    [
        pytest.param("sp3_wide_ranks", marks=pytest.mark.lane("launch_3_ranks")),
        pytest.param("sp4_wide_ranks", marks=pytest.mark.lane("launch_4_ranks")),
    ],
    ids=["3", "4"],
)
def test_sp_size_not_dividing_the_heads(request, synth, launch):
    """6 query / 2 KV heads (the wide tiny checkpoints; Qwen2.5-VL with several vision windows per frame) on sp_size
    ranks vs one process: sp 3 repeats each KV head 3 times, sp 4 pads the 6 heads to 8 with zero heads (and repeats
    every KV head to its query heads). Log-probs, entropy, losses and every gradient as test_sp2's; the exchange's
    own gradient (sp.AllToAll, uneven splits) equals its one-process adjoint."""
    from safetensors.torch import load_file

    sp_size, _, _, *names = CONFIGS[launch]
    tmp_path = request.getfixturevalue(launch)
    for name in names:
        ref = run(name, os.path.join(synth, "train.jsonl"), 1, None)
        check_against(
            ref,
            [load_file(tmp_path / f"{name}.rank{r}.safetensors") for r in range(sp_size)],
            sp_size,
        )
    # one process: rank r's rows [sum(send[:j]), + send[j]) land in rank j's y at rank j's recv offset for r
    sizes = [exchange_sizes(r, sp_size) for r in range(sp_size)]
    w = [
        torch.randn(
            sum(recv), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + r)
        )
        for r, (_, recv) in enumerate(sizes)
    ]
    for r, (send, _) in enumerate(sizes):
        want = torch.cat([w[j][sum(sizes[j][1][:r]) :][: send[j]] for j in range(sp_size)])
        torch.testing.assert_close(
            load_file(tmp_path / f"exchange.rank{r}.safetensors")["grad"], want, rtol=0, atol=0
        )


def test_config_errors(tiny_model):
    """The world must be a multiple of sp_size; a vLLM TP group must lie inside an SP group (sp_size % rollout_tp).
    All before any model loads. sp_size need not divide the heads (2 here): Ulysses pads them."""
    train.check_config(
        tiny_config(model=tiny_model, sp_size=2, prompts_per_step=4), world=4
    )  # dp 2 x sp 2: fine
    train.check_config(tiny_config(model=tiny_model, sp_size=4, prompts_per_step=4), world=4)
    with pytest.raises(ValueError, match=r"world size 3 % sp_size 2"):
        train.check_config(tiny_config(model=tiny_model, sp_size=2, prompts_per_step=3), world=3)
    with pytest.raises(ValueError, match=r"sp_size 2 % rollout_tp 4 != 0"):
        train.check_config(
            tiny_config(model=tiny_model, sp_size=2, rollout_tp=4, prompts_per_step=4), world=4
        )
    train.check_config(  # a TP group inside each SP group
        tiny_config(model=tiny_model, sp_size=4, rollout_tp=2, prompts_per_step=4), world=4
    )
    with pytest.raises(ValueError, match="sp_size must be > 0"):
        train.check_config(tiny_config(model=tiny_model, sp_size=0))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_linear_attention_refuses_sp(arch):
    """Qwen3.5's gated delta-net layers run their recurrence inside the layer, over the positions it is given:
    sp_size > 1 is refused before anything loads (a local checkpoint's config.json, or a hub name's published one)."""
    for model in (model_dir(arch), "Qwen/Qwen3.5-9B"):
        cfg = tiny_config(model=model, rollout="hf", prompts_per_step=4)
        with pytest.raises(ValueError, match="linear-attention layers need sp_size 1"):
            train.check_config(replace(cfg, sp_size=2), world=2)
        train.check_config(cfg, world=2)


@background("launch_2_ranks")
def two_rank_launch(tmp_path_factory):
    """One 2-rank torchrun launch (tests/train_worker.py), in conftest's background lane: the sp2 and dp2
    configurations, then train.py with sp_size 2: 2 steps with the HF sampler, a checkpoint each step, then resumed
    with the vLLM sampler (and freeze_vision: features once per step) for a third (the launch's one vLLM engine,
    last). Returns (its folder, train_worker.Launch)."""
    from train_worker import start

    tmp_path = tmp_path_factory.mktemp("launch_2_ranks")
    args = [
        "--config",
        "configs/tiny_cpu.yaml",
        "--model",
        model_dir("qwen2_5_vl"),
        "--train-data",
        os.path.join(synth_dir(), "train.jsonl"),
        "--val-data",
        "",
        "--out-dir",
        str(tmp_path / "run"),
        "--group-size",
        "2",
        "--prompts-per-step",
        "2",
        "--no-save",
        "--cache-dir",
        "",
        "--sp-size",
        "2",
        "--save-every",
        "1",
        "--dist-timeout",
        "120",
    ]
    runs = (
        ["--max-steps", "2", "--rollout", "hf"],
        [
            "--max-steps",
            "3",
            "--rollout",
            "vllm",
            "--resume",
            "auto",
            "--freeze-vision",
            "--allow-config-change",
        ],
    )
    workers = [worker_run(tmp_path, "sp2_ranks"), worker_run(tmp_path, "dp2_ranks")]

    def run():
        return tmp_path, start(workers + [args + extra for extra in runs])

    return run


@pytest.mark.slow
@pytest.mark.lane("launch_2_ranks")
def test_train_run_and_resume(tmp_path_factory):
    """launch_2_ranks' train.py runs: every step trains prompts_per_step distinct samples (the SP pair holds one copy),
    and decodes each of their videos once (by the rank that generates its prompt; each rank did before)."""
    import json
    import math

    tmp_path, result = lane_result("launch_2_ranks", tmp_path_factory)
    logs = [result.log(k) for k in (2, 3)]
    assert "resumed from" in logs[1]
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    videos = {
        s["id"]: len(s.get("videos", []))
        for s in data.load_samples(os.path.join(synth_dir(), "train.jsonl"))
    }
    assert sum(videos[i] for r in rows for i in r["data/ids"]) > 0
    for r in rows:
        assert r["cache/decode"] == sum(
            videos[i] for i in r["data/ids"]
        )  # no cache: a load is a decode
        assert math.isfinite(r["loss"]) and len(r["data/ids"]) == len(set(r["data/ids"])) == 2
        assert (
            r["vision/encodes"] >= 4
        )  # per rank at least one piece of each modality (a dummy where none)
        assert (
            r["mismatch/mean"] < 1e-2
        )  # the sampler's log-probs vs the SP trainer's, on the same tokens


if __name__ == "__main__":
    worker(*sys.argv[1:])


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_runs_built_from_frames_are_the_processors_rows(arch):
    """sp.build_run (a TP peer's run, built from the uint8 frames sp.share_prompts passes it): the rows data.prepare's
    processor makes of the whole prompt, bit for bit, every run of 2 and 3 (a video cut mid-way, an image, both)."""
    import cache
    import sp
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir(arch))
    samples = data.load_samples(os.path.join(synth_dir(), "train.jsonl"))
    video = next(s for s in samples if s.get("videos"))
    image = next(s for s in samples if s.get("images"))
    both = dict(video, id="both", images=image["images"], data_type="video")
    media = cache.Media(cache_dir="", video_source="decode_only")
    checked = 0
    expected = 0
    for sample in (video, image, both):
        p = data.prepare(sample, processor, media)
        expected += 2 * sum(len(v) for k, v in p.mm.items() if k.startswith("pixel"))
        for n in (2, 3):
            for j in range(n):
                for pixels, rows in sp.build_run(processor, p, j, n).items():
                    grid = pixels.replace("pixel_values", "image_grid_thw").replace(
                        "image_grid_thw_videos", "video_grid_thw"
                    )
                    assert torch.equal(rows, sp.run_rows(p, pixels, grid, j, n)), (
                        sample["id"],
                        n,
                        j,
                    )
                    checked += len(rows)
    assert checked == expected  # every row of every run of 2 and 3


@pytest.mark.parametrize(
    "world,sp_size,tp", [(1, 1, 1), (4, 1, 2), (4, 2, 1), (4, 2, 2), (8, 1, 4), (6, 3, 1)]
)
def test_layout_shares(world, sp_size, tp):
    """Layout's rank arithmetic over a whole world: SP group g's ranks hold items[g::dp_size] between them (its
    equal part in one round), rank r's own part lies inside its TP group's list, which is the same on the group's
    ranks; the parts partition the items; an item is prepared by the one rank whose part holds it;
    dedup keeps one rank per SP group."""
    import sp

    items = list(range(23))
    dp = world // sp_size
    layouts = [
        sp.Layout(None, r % sp_size, sp_size, r // sp_size, dp, tp, r, world) for r in range(world)
    ]
    own = [x.part(items, r) for r, x in enumerate(layouts)]
    assert sorted(i for part in own for i in part) == items
    for g in range(dp):
        group_parts = own[g * sp_size : (g + 1) * sp_size]
        assert sorted(i for part in group_parts for i in part) == items[g::dp]
    if sp_size == 1:
        assert own == [items[r::world] for r in range(world)]
    for r, x in enumerate(layouts):
        tp_share = x.share(items, tp)
        share = tp_share.items
        assert tp_share.own() == own[r]
        assert share == layouts[r - r % tp].share(items, tp).items
        assert sorted(share) == sorted(
            i for q in range(r - r % tp, r - r % tp + tp) for i in own[q]
        )
    for i in (
        items
    ):  # one rank prepares an item: the one whose part holds it (share_prompts, group_rollouts)
        preparers = [r for r, x in enumerate(layouts) if x.prepares(i)]
        assert preparers == [r for r in range(world) if i in own[r]]
    assert layouts[0].dedup(list(range(world))) == list(range(0, world, sp_size))

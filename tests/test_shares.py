"""Even shares (issue 40): a step's prompts dealt so that every SP group gets prompts_per_step / dp_size of them in
one round, its TP groups generating inside it; the 4-rank runs (sp 2, 2/4/6 prompts per step) in one generation round
each, no prompt generated and thrown away."""

import itertools
import json
import os

import pytest
from conftest import ROOT

import rehearse
import sp


def layouts(world: int, sp_size: int, tp: int) -> list[sp.Layout]:
    return [
        sp.Layout(None, r % sp_size, sp_size, r // sp_size, world // sp_size, tp, r, world)
        for r in range(world)
    ]


CASES = [
    (world, sp_size, tp, per_group * world // sp_size)
    for world, sp_size, tp, per_group in itertools.product(
        (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 3, 5)
    )
    if world % sp_size == 0 and world % tp == 0 and (sp_size == 1 or sp_size % tp == 0)
]


@pytest.mark.parametrize("world,sp_size,tp,prompts", CASES)
def test_every_sp_group_gets_its_equal_part(world, sp_size, tp, prompts):
    """The ranks' parts partition the step's prompts; an SP group's parts (what group_rollouts joins) are exactly
    prompts / dp_size, the same list on its ranks; each TP group's engine gets the parts of its ranks, and a prompt is
    prepared (data.next_valid) by the one rank whose part holds it (sp.share_prompts passes it to its TP group); the
    engines of an SP group get even loads (2 prompts on sp 4 / rollout_tp 2: one each, not both on the first)."""
    items = list(range(prompts))
    ranks = layouts(world, sp_size, tp)
    parts = [ranks[0].part(items, r) for r in range(world)]
    assert sorted(x for part in parts for x in part) == items
    for layout in ranks:
        group = layout.share(items, sp_size).items
        assert len(group) == prompts // layout.dp_size
        assert group == ranks[layout.rank - layout.sp_rank].share(items, sp_size).items
        tp_share = layout.share(items, tp)
        share = tp_share.items
        assert tp_share.own() == parts[layout.rank]
        assert set(share) <= set(group) or sp_size == 1
        assert [i for i in items if layout.prepares(i)] == sorted(tp_share.own())
    # inside an SP group, every engine generates its share: the loads differ by at most one prompt
    if sp_size > 1:
        for first in range(0, world, sp_size):
            loads = [
                len(ranks[q].share(items, tp).items) for q in range(first, first + sp_size, tp)
            ]
            assert max(loads) - min(loads) <= 1


def test_sp_size_1_deals_as_before():
    """sp_size 1: rank r takes items[r::world], as every data-parallel run before."""
    items = list(range(11))
    for layout in layouts(4, 1, 2):
        assert layout.part(items, layout.rank) == items[layout.rank :: 4]


RUNS = {  # name -> (sp_size, rollout_tp, prompts_per_step) on 4 ranks
    "sp2_p2": (2, 1, 2),
    "sp2_p4": (2, 1, 4),
    "sp2_p6": (2, 1, 6),
    "sp4_tp2": (4, 2, 4),  # with vllm_embeds: the SP group's runs encoded, gathered for vLLM
    "sp4_tp2_p2": (4, 2, 2),  # one prompt for each engine
}
EMBEDS = ["--freeze-vision", "--vllm-embeds"]


# the 3B hour recipe's layout at 4 ranks, rehearsed (scripts/rehearse.py's train.py command line) in the same launch
REHEARSAL = [
    os.path.join(ROOT, "configs", n) for n in ("qwen2_5_vl_3b.yaml", "qwen2_5_vl_3b_long.yaml")
]


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory, tiny_model, color_data) -> dict:
    """The RUNS, 2 steps each, then the rehearsal, in one 4-rank torchrun launch (tests/train_worker.py), real vLLM
    engines: torchrun's start and the ranks' imports are paid once (the rehearsal had a launch of its own: ~25 s).
    Returns name -> (its folder, the train_worker.Launch, its index there)."""
    import train
    from train_worker import start

    root = tmp_path_factory.mktemp("shares")
    argv = [
        [
            *("--config", "configs/tiny_cpu.yaml", "--model", tiny_model),
            *("--train-data", f"{color_data}/train.jsonl", "--val-data", ""),
            *("--out-dir", str(root / name), "--max-steps", "2", "--group-size", "2"),
            *("--sp-size", str(sp_size), "--rollout-tp", str(tp)),
            *("--prompts-per-step", str(prompts), "--video-source", "decode_only"),
            "--no-save",
            *EMBEDS * (name == "sp4_tp2"),
        ]
        for name, (sp_size, tp, prompts) in RUNS.items()
    ]
    (root / "four.yaml").write_text("sp_size: 4\nrollout_tp: 2\n")
    c = rehearse.Config(config=(*REHEARSAL, str(root / "four.yaml")), out=str(root / "rehearsal"))
    argv.append(rehearse.prepare(c, train.load_config(["--config", *c.config]), 4, "4 ranks"))
    launch = start(argv, nproc=4, timeout=1500)
    return {name: (root / name, launch, k) for k, name in enumerate([*RUNS, "rehearsal"])}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_four_ranks_one_round_per_step(name, four_rank_runs):
    """4 ranks, sp 2 with 2, 4 and 6 prompts per step (1, 2, 3 per SP group: before, 2 crashed at step 1 and 6 took
    two generation rounds, 12 prompts generated for 6 trained), and sp 4 with rollout_tp 2 (two engines, each inside
    the SP group; with 2 prompts, one each): every step is one generation round and trains every prompt it generated."""
    folder, launch, k = four_rank_runs[name]
    log = launch.log(k)
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2], log[-3000:]
    assert all(r["dyn/rounds"] == 1 and r["dyn/dropped"] == 0 for r in rows), rows
    ids = [i for r in rows for i in r["data/ids"]]  # the prompts trained, each once
    assert len(ids) == len(set(ids)) == 2 * RUNS[name][2], ids
    assert all(
        r["mismatch/max"] < 1e-5 for r in rows
    )  # vLLM's log-probs are the trainer's (tp 2 too: a TP peer's runs built from the frames)
    # each prompt decoded once in the world (tp 2: by one rank of its engine, not both)
    assert [r["cache/decode"] for r in rows] == [RUNS[name][2]] * 2, rows
    if name == "sp4_tp2":  # vllm_embeds: one encode a step, for vLLM and logp_pass alike: the 4
        # prompts' runs on each of the 4 ranks, and each rank's image dummy (FSDP2's aligned tower)
        assert [r["vision/encodes"] for r in rows] == [4 * 4 + 4] * 2, rows


@pytest.mark.slow
def test_four_rank_rehearsal(four_rank_runs):
    """The 3B hour recipe's layout at 4 ranks (sp_size 4, rollout_tp 2: two vLLM engines of 16 / 2 heads, each inside
    the SP group; KL reference, the tower trained, one row per micro-batch): 2 steps, one generation round each,
    each prompt decoded once; rehearse.verdict calls it rehearsed."""
    folder, launch, k = four_rank_runs["rehearsal"]
    log = launch.log(k)
    assert rehearse.verdict(rehearse.Config(out=str(folder)), 0, "4 ranks") == 0, log[-3000:]
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    steps = [r for r in rows if "dyn/rounds" in r]
    assert [r["dyn/rounds"] for r in steps] == [1, 1]
    assert all(r["mismatch/max"] < 1e-4 for r in steps)
    # each prompt decoded once (by one rank of its engine: sp.share_round), the held-out ones too
    assert [r["cache/decode"] for r in steps] == [8, 8]  # the recipe's prompts_per_step
    for step in (0, 2):
        ids = [json.loads(x)["doc_id"] for x in open(folder / "eval" / f"step_{step}.jsonl")]
        assert len(ids) == len(set(ids)) == 8

"""The RL algorithm family in train.py: hand-computed values, gradient checks, split invariance, smoke runs.

    .venv/bin/python -m pytest -q tests/test_algos.py

The pure functions are checked on small tensors against values worked out by hand (verl 0.9.1 definitions,
docs/algorithms.md). Split invariance runs the real tiny model: the loss and gradient of a batch
of 8 must not change when it is cut into 4 micro-batches of 2, nor under FSDP2 on 2 ranks (torchrun, gloo).
The same torchrun job then runs 2 training steps of every configs/<algorithm>.yaml, one after the other in
the same processes, sampling with the HF engine (a 3rd vLLM engine built in one torchrun process hung here;
tests/test_train.py covers the vLLM path of the same loop). The job is this file's worker(), a run of
conftest.shared_2_ranks' 2-rank launch (with test_joint's and test_rollout's):

    torchrun --nproc_per_node=2 tests/test_algos.py OUT MODEL DATA_DIR GAE_MODEL

GAE_MODEL (Qwen3.5: the gae run and its resume are also the exact resume of a linear-attention model).
"""

import dataclasses
import json
import math
import os
import shutil
import sys
import typing

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import SHARED_RUNS, algo_data_dir, tiny_model_dir  # noqa: E402
from train import (
    Config,
    Group,
    advantages,
    agg_loss,
    check_config,
    has_spread,
    is_weight,  # noqa: E402
    kl_penalty,
    load_config,
    overlong_penalty,
    policy_loss,
    reward_to_go,
    split_batch,
    whiten,
)

ALGOS = [
    "grpo",
    "drgrpo",
    "dapo",
    "gspo",
    "cispo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "gdpo",
]
COMBOS = [
    ("ppo", "token-mean"),
    ("ppo", "seq-mean-token-sum"),
    ("ppo", "seq-mean-token-mean"),
    ("ppo", "seq-mean-token-sum-norm"),
    ("gspo", "seq-mean-token-mean"),
    ("cispo", "token-mean"),
]
t = torch.tensor
approx = pytest.approx


# ----------------------------------------------------------------------------------------------- advantages
def test_grpo_group_stats_all_equal_and_singleton():
    a = advantages(t([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4, "grpo")[:, 0]
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert a.tolist() == approx(
        [x * 0.5 / (s + 1e-6) for x in (1, -1, -1, 1)] + [0.0] * 4, abs=1e-6
    )  # all-equal: 0
    assert advantages(t([3.0, -1.0]), 1, "grpo")[:, 0].tolist() == approx(
        [3 / (1 + 1e-6), -1 / (1 + 1e-6)]
    )  # mean 0, std 1


def test_drgrpo_rloo_remax():
    r = t([1.0, 0.0, 0.0, 1.0])
    assert advantages(r, 4, "drgrpo")[:, 0].tolist() == approx([0.5, -0.5, -0.5, 0.5])
    assert advantages(r, 4, "rloo")[:, 0].tolist() == approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3]
    )  # r_i - mean of the others
    assert advantages(t([2.0, 5.0]), 1, "rloo")[:, 0].tolist() == [
        2.0,
        5.0,
    ]  # verl's loop version: no baseline
    assert advantages(t([2.0, 5.0]), 1, "drgrpo")[:, 0].tolist() == [2.0, 5.0]
    assert advantages(r, 4, "remax", baseline=t([1.0, 1.0, 0.0, 0.0]))[:, 0].tolist() == [
        0.0,
        -1.0,
        0.0,
        1.0,
    ]


def masked_whiten_verl(x, lengths):
    """verl's masked_whiten on the (B, T) broadcast of x, written out on tokens (the independent check)."""
    T = int(max(lengths))
    mask = (torch.arange(T)[None] < t(lengths)[:, None]).double()
    v = x.double()[:, None].expand(-1, T)
    n = mask.sum()
    mean = (v * mask).sum() / n
    var = (((v - mean) ** 2) * mask).sum() / n * n / (n - 1)
    return ((v - mean) * torch.rsqrt(var + 1e-8))[:, 0]


def test_grpo_passk_by_hand():
    """Pass@k (k = group size): all right, none right, a tie at the top: 0 for all; one right: only
    it, 1 / (std + eps) (std of [0, 1, 0, 0] = 0.5); the group's best in every group at once."""
    r = t([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    a = advantages(r, 4, "grpo_passk")[:, 0].tolist()
    assert a == [0.0] * 4 + [0.0] * 4 + [0.0, 1 / (0.5 + 1e-6), 0.0, 0.0] + [0.0] * 4
    # 0.9 leads 0.5 by 0.4; the std of [0.2, 0.9, 0.5] is sqrt(0.37 / 3)
    a = advantages(t([0.2, 0.9, 0.5]), 3, "grpo_passk", eps=0.0)[:, 0].tolist()
    assert a == approx([0.0, 0.4 / math.sqrt(0.37 / 3), 0.0])


def test_grpo_passk_is_leave_one_out_max_with_k_the_group():
    """arXiv 2503.19595's estimator with k = n: sample i's advantage is max of the group - max of
    the others, over the group's std + eps (verl's norm_adv_by_std_in_grpo)."""
    torch.manual_seed(0)
    r = torch.rand(5, 6, dtype=torch.float64)
    got = advantages(r.flatten(), 6, "grpo_passk")[:, 0].view(5, 6)
    for g in range(5):
        for i in range(6):
            others = torch.cat([r[g, :i], r[g, i + 1 :]])
            want = (r[g].max() - others.max()) / (r[g].std() + 1e-6)
            assert got[g, i].item() == approx(want.item(), abs=1e-12)
    with pytest.raises(ValueError, match="grpo_passk needs group_size >= 2"):
        check_config(Config(adv_estimator="grpo_passk", group_size=1, rollout="hf"))
    cfg = load_config(["--config", "configs/tiny_cpu.yaml", "configs/grpo_passk.yaml"])
    assert cfg.adv_estimator == "grpo_passk"
    check_config(dataclasses.replace(cfg, rollout="hf"))  # vLLM's own checks are not the point here


def test_whitening_estimators():
    assert whiten(t([1.0, 0.0]), t([1, 3])).tolist() == approx(
        [1.5, -0.5], abs=1e-6
    )  # by hand: mean 1/4, std 1/2
    r, lens = t([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 0.0, 0.0]), [4, 2, 7, 1, 3, 3, 5, 6]
    assert advantages(r, 4, "reinforce++", lengths=t(lens))[:, 0].tolist() == approx(
        masked_whiten_verl(r, lens).tolist(), abs=1e-5
    )
    centered = t([0.5, -0.5, -0.5, 0.5, 2.0, 0.0, -1.0, -1.0])  # group means 0.5 and 1
    assert advantages(r, 4, "reinforce++-baseline", lengths=t(lens))[:, 0].tolist() == approx(
        masked_whiten_verl(centered, lens).tolist(), abs=1e-5
    )


def test_gdpo_normalizes_components_separately():
    acc, fmt = t([1.0, 1.0, 0.0, 0.0]), t([1.0, 0.0, 0.0, 0.0])
    a = advantages(acc + fmt, 4, "gdpo", lengths=t([2, 2, 2, 2]), components=[acc, fmt])[:, 0]
    ga, gf = (
        math.sqrt(3) / 2,
        1.5,
    )  # per-component GRPO: acc -> +-0.866, fmt -> [1.5, -.5, -.5, -.5]
    s = [ga + gf, ga - gf / 3, -ga - gf / 3, -ga - gf / 3]  # sums to 0
    std = math.sqrt(2 * sum(x * x for x in s) / 7)  # over 8 tokens, unbiased: sum 2 x^2 / (8 - 1)
    assert a.tolist() == approx([x / std for x in s], abs=1e-5)
    grpo = advantages(acc + fmt, 4, "grpo")[:, 0]
    assert not torch.allclose(
        a, grpo, atol=1e-3
    )  # the decoupled normalization is a different estimator


def test_kl_in_reward_is_reward_to_go():
    """Defect 1: with kl_in_reward, REINFORCE++ and ReMax return at token t the reward minus the KL from t onwards
    (gamma 1, as verl); the other estimators take the whole sequence's KL off the reward."""
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])  # kl_coef * KL per token; row 2 has 2 tokens
    to_go = reward_to_go(kl)
    assert to_go.tolist() == [approx([0.6, 0.5, 0.3]), approx([0.9, 0.5, 0.0])]
    reward, lengths = t([1.0, 0.0]), t([3, 2])
    remax = advantages(
        reward, 1, "remax", response_len=3, lengths=lengths, baseline=t([0.5, 0.5]), kl_to_go=to_go
    )
    assert remax.tolist() == [
        approx([-0.1, 0.0, 0.2]),
        approx([-1.4, -1.0, 0.0]),
    ]  # 1 - 0.6 - 0.5, ...
    # returns [0.4, 0.5, 0.7], [-0.9, -0.5] over 5 tokens: mean 0.04, unbiased variance 1.952 / 4
    std = math.sqrt(1.952 / 4 + 1e-8)
    rpp = advantages(reward, 1, "reinforce++", response_len=3, lengths=lengths, kl_to_go=to_go)
    assert rpp.tolist() == [
        approx([0.36 / std, 0.46 / std, 0.66 / std]),
        approx([-0.94 / std, -0.54 / std, 0.0]),
    ]
    # GRPO: rewards 1 - 0.6 and 0 - 0.9 in one group of 2: +-0.65 / std(0.4, -0.9)
    a = 0.65 / (math.sqrt(2 * 0.65**2) + 1e-6)
    grpo = advantages(reward, 2, "grpo", response_len=3, lengths=lengths, kl_to_go=to_go)
    assert grpo.tolist() == [
        approx([a] * 3),
        approx([-a] * 3),
    ]  # the sequence's value at each token


def summed_grads(model, total: torch.Tensor) -> tuple[float, dict]:
    """The loss summed over ranks and every parameter's whole gradient (FSDP2 shards gathered), the
    gradients then cleared."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.all_reduce(total)
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return total.item(), grads


# train.Config's critic-free estimators (gae needs values: its own tests below)
ESTIMATORS = [
    e for e in typing.get_args(typing.get_type_hints(Config)["adv_estimator"]) if e != "gae"
]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_have_one_shape(estimator):
    """Every estimator, KL in the reward or not, returns (B, response_len): per-sequence estimators
    their sequence's value at each token."""
    reward = t([1.0, 0.0, 0.5, 0.25])
    kw = dict(
        lengths=t([3, 2, 1, 3]), baseline=t([0.5] * 4), components=[reward, t([1.0, 0, 0, 1])]
    )
    plain = advantages(reward, 2, estimator, response_len=3, **kw)
    with_kl = advantages(reward, 2, estimator, response_len=3, kl_to_go=torch.zeros(4, 3), **kw)
    assert plain.shape == with_kl.shape == (4, 3)
    assert plain.dtype == with_kl.dtype == torch.float64
    assert (plain == plain[:, :1]).all() and plain.abs().sum() > 0


@pytest.mark.parametrize("n", [3, 4, 7, 8])
def test_constant_group_advantage_is_exactly_zero(n):
    """Defect 2: a group whose rewards are all 0.9 (or 0.1, 0.7) gets exactly 0, not a float32 rounding error
    divided by a tiny std (about -0.06); the advantages are float64."""
    for v in (0.9, 0.1, 0.7):
        reward = t([v] * n + [1.0] + [0.0] * (n - 1), dtype=torch.float32)
        for estimator in (
            "grpo",
            "drgrpo",
            "rloo",
        ):  # (batch whitening then shifts every group: not 0)
            a = advantages(reward, n, estimator)[:, 0]
            assert a.dtype == torch.float64
            assert a[:n].tolist() == [0.0] * n, (estimator, v)
            assert a[n] > 0 > a[n + 1]


def test_dynamic_sampling_filters_on_configured_metric():
    """Defect 3: DAPO drops groups whose ACCURACY is the same for every rollout (its default), even when the overall
    reward differs (here the format reward); dyn_filter_metric: reward filters on the overall reward."""
    comps = [
        {"accuracy": 1.0, "format": 1.0, "overall": 1.0},
        {"accuracy": 1.0, "format": 0.0, "overall": 0.9},
    ]
    same_acc = Group([None, None], comps)
    assert Config().dyn_filter_metric == "accuracy"
    assert not has_spread(same_acc, "accuracy") and has_spread(same_acc, "reward")
    comps = [
        {"accuracy": 1.0, "overall": 0.9},
        {"accuracy": 0.0, "overall": 0.9},
    ]  # e.g. an overlong penalty
    assert has_spread(Group([None, None], comps), "accuracy")
    assert not has_spread(Group([None, None], comps), "reward")
    assert has_spread(Group([None], comps[:1]), "accuracy")  # a group of 1 is never dropped


def test_clip_ratio_c_must_exceed_one():
    """Defect 4: a dual-clip bound in (0, 1] would cap the loss of every negative-advantage token below its
    unclipped value: a config error. 0 turns it off."""
    for c in (0.5, 1.0, -2.0):
        with pytest.raises(ValueError, match="clip_ratio_c"):
            check_config(Config(clip_ratio_c=c))
    for c in (0.0, 1.5, 10.0):
        check_config(Config(clip_ratio_c=c))


def test_offline_output_with_special_tokens_is_a_data_error(tmp_path, synth):
    """Defect 5: an offline_output holding a special token (<|image_pad|>) would be tokenized as that token, which
    the trainer bans (log-prob -1e9): an error naming the line and sample at load time (train.main passes the
    tokenizer's special tokens to load_samples), or a skip report."""
    import data

    good = json.loads(open(f"{synth}/train.jsonl").readline())
    path = tmp_path / "train.jsonl"
    shutil.copytree(f"{synth}/videos", tmp_path / "videos")  # its media where its paths say
    rows = [
        {**good, "id": "ok", "offline_output": "<answer>B</answer>"},
        {**good, "id": "s7", "offline_output": "<answer>B</answer><|image_pad|>"},
        {**good, "id": "no-offline", "offline_output": ""},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        data.DataError, match=r"jsonl:2: sample s7: field 'offline_output' contains '<\|image_pad"
    ):
        data.load_samples(str(path), special_tokens=["<|image_pad|>"])
    skipped = []
    kept = data.load_samples(
        str(path), skip_invalid=True, skipped=skipped, special_tokens=["<|image_pad|>"]
    )
    assert [s["id"] for s in kept] == ["ok", "no-offline"]
    assert (
        len(skipped) == 1
        and skipped[0]["where"] == f"{path}:2"
        and "<|image_pad|>" in skipped[0]["error"]
    )


def test_greedy_temperature_and_negative_keep_last_are_config_errors():
    """--temperature 0 (vLLM: greedy below 1e-5) would train on NaN log-probs; a negative --keep-last deleted the
    checkpoint just written."""
    for bad, says in (
        (dict(temperature=0.0), "temperature 0.0"),
        (dict(temperature=1e-6), "greedy"),
        (dict(keep_last=-1), "keep_last must be >= 0, got -1"),
    ):
        with pytest.raises(ValueError, match=says):
            check_config(Config(**bad))
    check_config(Config(temperature=1e-5, keep_last=0))


def test_config_files_apply_in_order():
    """`--config run.yaml recipe.yaml`: the recipe's keys over the run's, flags over both; every algorithm recipe the
    README lists holds only algorithm keys (Config's algorithm section, micro_batch_size aside: a run's size), so a
    recipe over the 7B's config cannot change its response length (dapo.yaml's max_response_len 12 once did)."""
    import re

    import yaml

    cfg = load_config(
        ["--config", "configs/tiny_cpu.yaml", "configs/dapo.yaml", "--clip-high", "0.3"]
    )
    assert (cfg.max_steps, cfg.group_size, cfg.max_response_len) == (60, 8, 8)  # tiny_cpu.yaml
    assert (cfg.overlong_buffer, cfg.dynamic_sampling, cfg.clip_high) == (
        0.2,
        True,
        0.3,
    )  # dapo.yaml, then the flag
    names = [f.name for f in dataclasses.fields(Config)]
    algorithm = set(names[names.index("adv_estimator") : names.index("micro_batch_size")])
    recipes = re.findall(r"^\| [^|]+ \| \[configs/(\w+)\.yaml\]", open("README.md").read(), re.M)
    # ppo's 2-step run is critic_worker's; grpo_passk's advantages are checked by hand
    assert sorted(recipes) == sorted(ALGOS + ["ppo", "grpo_passk"])
    for name in recipes:
        assert set(yaml.safe_load(open(f"configs/{name}.yaml"))) <= algorithm, name


def test_unknown_keywords_raise():
    with pytest.raises(ValueError, match="adv_estimator"):
        advantages(t([1.0, 0.0]), 2, "grpoo")
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1.0]]), "ppo2")
    with pytest.raises(ValueError, match="loss_agg"):
        agg_loss(t([[1.0]]), t([[1.0]]), "token-sum", 1, 1, 1)
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


# ----------------------------------------------------------------------------------------------- policy losses
def grad_of(loss_type, logp0, old, adv, mask, agg="token-mean", **kw):
    logp = logp0.clone().requires_grad_(True)
    tok, clipped = policy_loss(logp, old, adv, mask, loss_type, **kw)
    loss = agg_loss(tok, mask, agg, mask.sum().item(), float((mask.sum(-1) > 0).sum()), 8)
    loss.backward()
    return loss.item(), logp.grad, tok.detach(), clipped


@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "cispo"])
def test_on_policy_is_plain_policy_gradient(loss_type):
    logp = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    adv, mask = (
        t([1.0, -2.0, 0.5]),
        t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]),
    )
    _, g, _, clipped = grad_of(loss_type, logp, logp.clone(), adv, mask)
    assert torch.allclose(
        g, -adv[:, None] * mask / mask.sum(), atol=1e-7
    )  # grad of -A logp, token-mean
    assert clipped.sum() == 0


def test_ppo_clip_boundaries_and_dual_clip():
    ratio = t([[0.5, 1.1, 1.28, 1.3], [0.5, 0.8, 2.0, 4.0]])
    logp0, old, mask = ratio.log(), torch.zeros(2, 4), torch.ones(2, 4)
    _, g, tok, clipped = grad_of(
        "ppo", logp0, old, t([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0
    )
    # A > 0: below 1 - eps is not clipped (pessimistic max), above 1 + eps is; exactly at the bound is not
    # A < 0: below 1 - eps is clipped (loss 0.8), above is not, and above c the loss stops at c |A| (dual clip)
    assert tok.tolist() == [approx([-0.5, -1.1, -1.28, -1.28]), approx([0.8, 0.8, 2.0, 3.0])]
    assert clipped.tolist() == [[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    has_grad = (g.abs() > 0).tolist()
    assert has_grad == [[True, True, True, False], [False, True, True, False]]
    assert g[0, 1].item() == approx(-1.1 / 8)  # d(-A r)/dlogp = -A r, token-mean over 8 tokens
    _, _, tok_nodual, _ = grad_of(
        "ppo", logp0, old, t([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=0
    )
    assert tok_nodual[1, 3].item() == approx(4.0)  # dual clip off


def test_gspo_gradient_is_sequence_level():
    g0 = torch.Generator().manual_seed(1)
    mask, adv = (
        t([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0] * 5, [1.0, 1.0, 0.0, 0.0, 0.0]]),
        t([1.0, -1.0, 0.5]),
    )
    noise = torch.randn(3, 5, generator=g0) * 0.1 * mask
    noise = (
        noise - (noise.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)) * mask
    )  # zero mean per row
    logp0 = torch.randn(3, 5, generator=g0) - 2
    old = (
        logp0 - noise - t([[math.log(1.02)], [math.log(1.2)], [math.log(1.2)]])
    )  # s = 1.02, 1.2, 1.2
    loss, g, _, clipped = grad_of(
        "gspo", logp0, old, adv, mask, "seq-mean-token-mean", clip_low=0.05, clip_high=0.05
    )
    # the paper's objective: -(1/B) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp - old))
    logp = logp0.clone().requires_grad_(True)
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    ref = -torch.minimum(s * adv, s.clamp(0.95, 1.05) * adv).mean()
    ref.backward()
    assert s.tolist() == approx([1.02, 1.2, 1.2], abs=1e-5)
    assert loss == approx(ref.item(), abs=1e-6)
    assert torch.allclose(g, logp.grad, atol=1e-7)
    # every token of a row gets the same gradient s_i A_i / (B |y_i|): inside the clip range, and A < 0 above it
    assert g[0, :3].tolist() == approx([-1.02 / 9] * 3) and g[1].tolist() == approx([1.2 / 15] * 5)
    assert (g[2] == 0).all() and clipped[2, :2].tolist() == [
        1.0,
        1.0,
    ]  # A > 0 above 1 + eps: clipped


def test_cispo_weight_is_clipped_and_detached():
    ratio = t([[0.5, 1.0, 1.5]])
    logp0, old, mask, adv = ratio.log() - 1, torch.full((1, 3), -1.0), torch.ones(1, 3), t([2.0])
    _, g, tok, clipped = grad_of("cispo", logp0, old, adv, mask, clip_low=0.2, clip_high=0.2)
    w = t([[0.8, 1.0, 1.2]])
    assert torch.allclose(tok, -w * 2.0 * logp0)
    assert torch.allclose(g, -w * 2.0 / 3)  # exactly -clip(r) A / N: no gradient through the weight
    assert clipped.tolist() == [[1.0, 0.0, 1.0]]


# ----------------------------------------------------------------------------------------------- aggregation, KL, IS
def test_agg_modes_by_hand_all_masked_row():
    x = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = t(
        [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    )  # last row fully masked: not a sequence
    assert agg_loss(x, mask, "token-mean", 3, 2, 3).item() == approx(7 / 3)
    assert agg_loss(x, mask, "seq-mean-token-sum", 3, 2, 3).item() == approx(3.5)
    assert agg_loss(x, mask, "seq-mean-token-mean", 3, 2, 3).item() == approx(2.75)
    assert agg_loss(x, mask, "seq-mean-token-sum-norm", 3, 2, 4).item() == approx(7 / 8)


def test_kl_estimators():
    logp, ref = t([0.0, 0.0, -50.0]), t([math.log(0.5), 0.0, 0.0])
    d = -math.log(0.5)
    assert kl_penalty(logp, ref, "k1").tolist() == approx([d, 0, -50])
    assert kl_penalty(logp, ref, "abs").tolist() == approx([d, 0, 50])
    assert kl_penalty(logp, ref, "k2").tolist() == approx([d * d / 2, 0, 1250])
    assert kl_penalty(logp, ref, "k3").tolist() == approx(
        [0.5 + d - 1, 0, 10.0], abs=1e-6
    )  # clamps: +-20 in, 10 out


def test_truncated_importance_weights():
    old = t([[math.log(3), math.log(0.5), 0.0], [0.0, 0.0, 0.0]])
    rollout = t([[0.0, 0.0, 0.0], [float("nan")] * 3])  # second row: offline, no sampler log-probs
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert is_weight(old, rollout, mask, "token", 2.0).tolist() == [
        approx([2.0, 0.5, 0.0]),
        [1.0, 1.0, 1.0],
    ]
    assert is_weight(old, rollout, mask, "token", 2.0, "mask").tolist() == [
        approx([0.0, 0.5, 0.0]),
        [1.0, 1.0, 1.0],
    ]
    assert is_weight(old, rollout, mask, "sequence", 2.0).tolist() == [
        approx([1.5, 1.5, 0.0]),
        [1.0, 1.0, 1.0],
    ]
    assert is_weight(old, rollout, mask, "sequence", 1.2).tolist() == [
        approx([1.2, 1.2, 0.0]),
        [1.0, 1.0, 1.0],
    ]


def test_overlong_penalty_and_split():
    assert [overlong_penalty(n, 12, 4) for n in (3, 8, 10, 12, 13)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    from data import Prompt
    from rollout import Rollout

    one = [
        Rollout(Prompt({}, "", [0]), [1], None, "") for _ in range(8)
    ]  # every row its own prompt
    assert split_batch(one, 1, 8) == [[list(range(8))]]
    assert split_batch(one, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert split_batch(one[:7], 2, 4) == [[[0, 1, 2]], [[3, 4, 5, 6]]]
    # groups: A x 3 (prompt 10 tokens, responses 2, 4, 1), B x 3 (10; 3, 3, 3), C x 2 (20; 5, 0)
    a, b, c = Prompt({}, "", [0] * 10), Prompt({}, "", [0] * 10), Prompt({}, "", [0] * 20)
    rows = [
        Rollout(p, [1] * n, None, "")
        for p, n in zip([a, a, a, b, b, b, c, c], [2, 4, 1, 3, 3, 3, 5, 0])
    ]
    assert split_batch(rows, 1, 4) == [
        [[0, 1, 2], [3, 4, 5], [6, 7]]
    ]  # a group is not cut where it fits whole
    assert split_batch(rows, 1, 2) == [
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    ]  # groups of 3 fit in no micro-batch of 2
    assert split_batch(rows, 2, 4) == [
        [[0, 1, 2, 3]],
        [[4, 5, 6, 7]],
    ]  # B is cut by the mini-batch bound
    # a budget of 40 padded tokens: A's rows 0-1 are 2 x (10 + 4) = 28, + row 2 42; B fits alone, 3 x 13 = 39; C's
    # rows are 25 tokens each with padding, one per micro-batch
    assert split_batch(rows, 1, 99, max_tokens=40) == [[[0, 1], [2], [3, 4, 5], [6], [7]]]


@pytest.mark.parametrize("loss_type,agg", COMBOS)
def test_micro_batch_invariance_tensors(loss_type, agg):
    """Summed over micro-batches with global counts, the loss and gradient equal the whole batch's."""
    g0 = torch.Generator().manual_seed(2)
    logp0, old = (
        torch.randn(8, 6, generator=g0) * 0.3 - 3,
        torch.randn(8, 6, generator=g0) * 0.3 - 3,
    )
    lens = t([6, 0, 3, 1, 5, 2, 6, 4])
    mask, adv = (torch.arange(6)[None] < lens[:, None]).float(), torch.randn(8, generator=g0)
    n_tok, n_seq = mask.sum().item(), float((lens > 0).sum())
    out = []
    for parts in ([slice(0, 8)], [slice(i, i + 2) for i in range(0, 8, 2)]):
        logp, total = logp0.clone().requires_grad_(True), 0.0
        for p in parts:
            tok, _ = policy_loss(logp[p], old[p], adv[p], mask[p], loss_type)
            loss = agg_loss(tok, mask[p], agg, n_tok, n_seq, 6)
            loss.backward()
            total += loss.item()
        out.append((total, logp.grad))
    assert out[0][0] == approx(out[1][0], abs=1e-6) and torch.allclose(
        out[0][1], out[1][1], atol=1e-7
    )


# ----------------------------------------------------------------------------------------------- held-out accuracy
def test_eval_row_scores_as_the_nvr1_benchmark():
    """train.eval_row (the held-out accuracy, from rewards) scores every response as evaluate.py's own-schema
    benchmark (nvr1) does: the same score, parse failure, answer read, target and id."""
    import data
    import evaluate
    from conftest import synth_dir
    from train import eval_row

    samples = data.load_samples(os.path.join(synth_dir(), "val.jsonl"))
    assert len({s["problem_type"] for s in samples}) == 3
    for s in samples:
        gt = s["answer"] if isinstance(s["answer"], str) else json.dumps(s["answer"])
        responses = [
            f"<answer>{gt}</answer>",
            f"<think>so</think><answer>{gt}</answer>",
            "<answer>C</answer>",
            "<answer>3</answer>",
            '<answer>{"time": [0.5, 1.5]}</answer>',
            "no answer here",
            "",
        ]
        for response in responses:
            mine = eval_row(s, "prompt", response)
            theirs = evaluate.record(s, "nvr1", "prompt", response)
            assert {k: theirs[k] for k in mine} == mine, (s["id"], response)
        assert eval_row(s, "prompt", responses[0])["score"] == 1.0


# ----------------------------------------------------------------------------------------------- real model
def model_batch(model_dir, data_dir):
    """Processor, 8 rollouts (2 video prompts x 4 random responses, one empty) and advantages: deterministic."""
    import data
    from conftest import tiny_config
    from rollout import Rollout, vision_token_ids
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    cfg = tiny_config(model=model_dir)
    samples = [s for s in data.load_samples(f"{data_dir}/train.jsonl") if s.get("videos")][:2]
    prompts = [data.prepare(s, processor, cfg) for s in samples]
    banned = vision_token_ids(processor.tokenizer)
    allowed = t([i for i in range(300) if i not in banned])
    g = torch.Generator().manual_seed(0)
    rollouts = []
    for i, n in enumerate([5, 1, 3, 0, 4, 2, 5, 3]):
        ids = allowed[torch.randint(len(allowed), (n,), generator=g)].tolist()
        logp = (torch.randn(n, generator=g) * 0.8 - 6).tolist()  # the "sampler" log-probs
        rollouts.append(Rollout(prompts[i // 4], ids, logp, "", "stop"))
    return processor, rollouts, torch.randn(8, generator=g), banned


def split_grads(
    model, processor, rollouts, adv, banned, loss_type, agg, micro_batch_size, max_tokens=0
):
    """Loss and full gradients of the batch `rollouts` (this rank's rows) cut into micro-batches, as main() does."""
    import torch.distributed as dist
    from conftest import tiny_config
    from conftest import global_counts
    from train import collate, micro_loss

    cfg = tiny_config(
        loss_type=loss_type,
        loss_agg=agg,
        kl_coef=0.1,
        entropy_coef=0.01,
        tis="token",
        tis_cap=1.2,
        max_response_len=8,
    )
    tok, world = processor.tokenizer, dist.get_world_size() if dist.is_initialized() else 1
    plan = split_batch(rollouts, 1, micro_batch_size, max_tokens)[0]
    batches = [
        collate([rollouts[j] for j in mb], tok.pad_token_id, torch.device("cpu")) for mb in plan
    ]
    n_tok, n_seq = global_counts(batches)
    total = torch.zeros(1, dtype=torch.float64)
    for mb, b in zip(plan, batches):
        rl = b.rollout_logp.nan_to_num()
        b.old_logp = rl + 0.3 * torch.sin(
            13 * rl
        )  # a trainer/sampler mismatch, elementwise: split-independent
        b.ref_logp = b.old_logp - 0.2
        b.adv = adv[mb]
        b.n_tok, b.n_seq = n_tok, n_seq
        loss, _ = micro_loss(model, b, cfg, banned)
        (loss * world).backward()
        total += loss.item()
    return summed_grads(model, total)


def assert_same(a, b):
    assert a[0] == approx(b[0], rel=1e-5, abs=1e-7)
    assert a[1].keys() == b[1].keys() and len(a[1]) > 10
    for k in a[1]:
        tol = 1e-5 * a[1][k].abs().max().item() + 1e-9
        assert torch.allclose(a[1][k], b[1][k], atol=tol, rtol=1e-4), k


@pytest.fixture(scope="module")
def algo_data():
    return algo_data_dir()


@pytest.fixture(scope="module")
def reference_grads(tiny_model, algo_data):
    from conftest import tiny_config
    from train import load_model

    model = load_model(tiny_config(model=tiny_model), torch.device("cpu"))
    processor, rollouts, adv, banned = model_batch(tiny_model, algo_data)
    return {
        combo: split_grads(model, processor, rollouts, adv, banned, *combo, 8) for combo in COMBOS
    }, (model, processor, rollouts, adv, banned)


@pytest.mark.slow
def test_micro_batch_invariance_real_model(reference_grads):
    ref, (model, processor, rollouts, adv, banned) = reference_grads
    P = len(rollouts[0].prompt.prompt_ids)
    # responses 5 1 3 0 | 4 2 5 3: with a budget of 3 x (P + 5) padded tokens, [0, 1, 2] [3, 4, 5] [6, 7]
    assert split_batch(rollouts, 1, 8, max_tokens=3 * (P + 5)) == [[[0, 1, 2], [3, 4, 5], [6, 7]]]
    for combo in COMBOS:
        assert_same(ref[combo], split_grads(model, processor, rollouts, adv, banned, *combo, 2))
        assert_same(
            ref[combo], split_grads(model, processor, rollouts, adv, banned, *combo, 8, 3 * (P + 5))
        )
    assert ref[COMBOS[0]][0] != approx(ref[COMBOS[1]][0])  # the modes do aggregate differently


@pytest.fixture(scope="module")
def torchrun_job(shared_2_ranks):
    """The 2-rank job (worker below: the FSDP2 gradients of the invariance batch, then 2 steps of every algorithm),
    a run of conftest.shared_2_ranks' launch. Returns its output folder."""
    out, result = shared_2_ranks
    result.log(SHARED_RUNS.index("algos"))
    return out / "algos"


@pytest.mark.slow
def test_rank_invariance_fsdp2(reference_grads, torchrun_job):
    got = torch.load(torchrun_job / "grads.pt", weights_only=True)
    for combo in COMBOS:
        loss, grads = got["/".join(combo)]
        assert_same(reference_grads[0][combo], (loss.item(), grads))


def metrics(out, name):
    return [json.loads(line) for line in open(out / name / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGOS)
def test_two_step_smoke(torchrun_job, name):
    rows = metrics(torchrun_job, name)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "entropy", "kl", "clipfrac"))
        assert r["mismatch/mean"] < 1e-4  # the HF engine samples from the training model itself
    if (
        name == "dapo"
    ):  # no offline mix here: the random model's groups are all-equal, dropped, then refilled
        assert 1 <= rows[0]["dyn/rounds"] <= 2 and rows[0]["dyn/dropped"] >= rows[0]["dyn/refilled"]
        assert (
            rows[0]["zero_std_groups"] * 4 == rows[0]["dyn/refilled"]
        )  # kept groups all have reward spread
        assert "reward/overlong" in rows[0] and rows[0]["tis/weight"] == approx(1.0, abs=1e-3)
    else:
        assert (
            rows[0]["dyn/rounds"] == 1 and rows[0]["grad_norm"] > 0
        )  # the offline answer gives a signal
    if name == "remax":
        assert "reward/greedy" in rows[0]
    cfg = json.load(open(torchrun_job / name / "summary.json"))["config"]
    need_old = cfg["ppo_epochs"] > 1 or cfg["mini_batches"] > 1 or cfg["kl_in_reward"]
    # per rank: 2 prompts (1 video each) + the dummy of the modality they lack (an image: FSDP2's tower alignment)
    if cfg["freeze_vision"]:
        assert [r["vision/encodes"] for r in rows] == [2 * 3] * 2  # once per step
    elif not cfg["max_tokens_per_micro_batch"]:
        # dp 2: the trained tower once per micro-batch of 4 = one group (its video + the dummy
        # image); the policy's no-grad encode for old log-probs and the reference's (new samples)
        update = cfg["ppo_epochs"] * 2 * 2
        before = 3 * (need_old + (cfg["kl_coef"] > 0))
        assert [r["vision/encodes"] for r in rows] == [2 * (update + before)] * 2
    if name in (
        "grpo",
        "reinforce_pp_baseline",
        "reinforce_pp",
    ):  # reference == policy at step 1 only
        assert abs(rows[0]["kl"]) < 1e-6 and abs(rows[1]["kl"]) > 0


def worker(out, model_dir, data_dir, gae_model):
    """Under torchrun: rank r takes rows [4r, 4r + 4) of the invariance batch in micro-batches of 2, then
    runs each algorithm config for 2 steps in this same process."""
    import torch.distributed as dist
    from conftest import tiny_config
    from train import init_dist, load_config, load_model, main

    rank, world, device = init_dist()
    model = load_model(tiny_config(model=model_dir), device)
    processor, rollouts, adv, banned = model_batch(model_dir, data_dir)
    rows = slice(4 * rank, 4 * rank + 4)
    got = {
        "/".join(c): split_grads(model, processor, rollouts[rows], adv[rows], banned, *c, 2)
        for c in COMBOS
    }
    if rank == 0:
        torch.save(
            {k: (torch.tensor(v[0]), v[1]) for k, v in got.items()}, os.path.join(out, "grads.pt")
        )
    del model
    for name in ALGOS:
        # dapo: filtered on the reward here, so that zero_std_groups (reward spread) counts exactly the refilled groups
        extra = {
            "dapo": ["--no-mix-offline", "--max-gen-rounds", "2", "--dyn-filter-metric", "reward"],
            "grpo": [
                "--freeze-vision"
            ],  # with a reference model: 2 trainer passes, the vision tower once
            "cispo": ["--max-tokens-per-micro-batch", "300", "--max-prompt-len", "150"],
        }.get(name, [])
        main(
            load_config(
                [
                    "--config",
                    "configs/tiny_cpu.yaml",
                    f"configs/{name}.yaml",
                    "--model",
                    model_dir,
                    "--train-data",
                    f"{data_dir}/train.jsonl",
                    "--val-data",
                    "",
                    "--out-dir",
                    os.path.join(out, name),
                    "--max-steps",
                    "2",
                    "--group-size",
                    "4",
                    "--prompts-per-step",
                    "4",
                    "--no-save",
                    "--cache-dir",
                    os.path.join(out, "frames"),
                    "--micro-batch-size",
                    "4",
                    "--rollout",
                    "hf",
                    *extra,
                ]
            )
        )
    critic_worker(out, model_dir, data_dir, gae_model)
    dist.barrier()


# ----------------------------------------------------------------------------------------------- gae (critic)
def test_gae_advantages_and_returns_by_hand():
    """verl's compute_gae_advantage_return, worked by hand (gamma 0.9, lam 0.5, 0.45 = gamma lam): a masked token
    (row 1's last, row 2's middle) keeps the next real token's value and advantage, and its reward is ignored."""
    from train import gae_advantages

    rewards = t([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0], [0.0, 7.0, 1.0]], dtype=torch.float64)
    values = t([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0], [0.1, 5.0, 0.3]], dtype=torch.float64)
    mask = t([[1, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=torch.float64)
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0: deltas 0.7, 0.9 * 0.3 - 0.2 = 0.07, 0.9 * 0.2 - 0.1 = 0.08; row 1: -0.5, 0.5 + 0.45 - 0.4 = 0.55;
    # row 2: 0.7 (t 2), passed through t 1, 0.9 * 0.3 - 0.1 = 0.17 at t 0
    raw = [[0.08 + 0.45 * 0.385, 0.07 + 0.45 * 0.7, 0.7], [0.55 - 0.45 * 0.5, -0.5, 0.0]]
    raw.append([0.17 + 0.45 * 0.7, 0.7, 0.7])
    assert returns.flatten().tolist() == approx(
        (t(raw, dtype=torch.float64) + values).flatten().tolist()
    )
    real = [a for row, m in zip(raw, mask.tolist()) for a, k in zip(row, m) if k]
    mean = sum(real) / len(real)
    std = math.sqrt(
        sum((a - mean) ** 2 for a in real) / (len(real) - 1) + 1e-8
    )  # unbiased, verl's + 1e-8
    want = [[(a - mean) / std * k for a, k in zip(row, m)] for row, m in zip(raw, mask.tolist())]
    assert adv.flatten().tolist() == approx(t(want).flatten().tolist())


def test_gae_batch_places_the_score_and_kl_and_lam_1_is_reward_to_go():
    """Per-token rewards as verl's apply_kl_penalty + the score at the last response token (an empty response gets
    none); with gamma = lam = 1 and zero values the returns are the rewards to go."""
    from train import gae_batch

    rows = {"length": [2, 0, 3], "reward": [1.0, 0.5, -1.0]}
    kl = t([[0.2, 0.4, 0, 0], [0, 0, 0, 0], [0.1, 0.1, 0.3, 0]], dtype=torch.float64)
    cfg = Config(adv_estimator="gae", kl_coef=0.1, kl_in_reward=True, max_response_len=4)
    adv, returns = gae_batch(rows, torch.zeros(3, 4, dtype=torch.float64), kl, cfg)
    want = [[1 - 0.06, 1 - 0.04, 0, 0], [0, 0, 0, 0], [-1 - 0.05, -1 - 0.04, -1 - 0.03, 0]]
    assert returns.flatten().tolist() == approx(t(want).flatten().tolist())
    mask = t([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    assert adv.flatten().tolist() == approx((whiten(returns, mask) * mask).flatten().tolist())


def test_value_loss_by_hand():
    """verl's compute_value_loss: 0.5 max((V - G)^2, (clip(V, V_old +- 0.2) - G)^2); a token where the clipped term
    wins has no gradient; token-mean over the mask."""
    from train import value_loss

    vpred = t([1.0, 0.0, 2.0], requires_grad=True)
    loss, clipped = value_loss(vpred, t([0.5, 0.1, 0.0]), t([0.0, 1.0, 3.0]), clip=0.2)
    # tok 0: clip 0.7, 1.0 vs 0.49; tok 1: inside [-0.1, 0.3], 1 vs 1; tok 2: clip 0.2, 1 vs 2.8^2 = 7.84
    assert loss.tolist() == approx([0.5, 0.5, 3.92]) and clipped.tolist() == [0.0, 0.0, 1.0]
    loss.sum().backward()
    assert vpred.grad.tolist() == approx([1.0, -1.0, 0.0])
    mask = t([[1.0, 1.0, 0.0]])
    assert agg_loss(loss[None], mask, "token-mean", 2.0, 1.0, 3).item() == approx(0.5)


def test_gae_settings_are_config_errors():
    for bad, match in [
        (dict(critic_warmup=2), "critic_warmup needs adv_estimator gae"),
        (dict(adv_estimator="gae", lam=1.5), "gamma 1.0 and lam 1.5"),
        (dict(adv_estimator="gae", sp_size=2), "gae needs sp_size 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_config(Config(rollout="hf", **bad), world=2)
    check_config(Config(rollout="hf", adv_estimator="gae", critic_warmup=2, gamma=0.99, lam=0.95))


def critic_grads(model, processor, rollouts, adv, micro_batch_size):
    """Value loss and full gradients of the critic on `rollouts` (this rank's rows) in micro-batches, as
    critic_update computes them: returns adv + 0.1 t per token, old values 0.5 G + 0.1 (some tokens clipped)."""
    import torch.distributed as dist
    from conftest import tiny_config
    from conftest import global_counts
    from train import collate, value_micro_loss

    cfg = tiny_config(cliprange_value=0.2, max_response_len=8)
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = split_batch(rollouts, 1, micro_batch_size)[0]
    batches = [
        collate([rollouts[j] for j in mb], processor.tokenizer.pad_token_id, torch.device("cpu"))
        for mb in plan
    ]
    n_tok, n_seq = global_counts(batches)
    total = torch.zeros(1, dtype=torch.float64)
    for mb, b in zip(plan, batches):
        b.returns = adv[mb][:, None] + 0.1 * torch.arange(b.mask.shape[1])
        b.values = 0.5 * b.returns + 0.1
        b.n_tok, b.n_seq = n_tok, n_seq
        loss, _ = value_micro_loss(model, b, cfg)
        (loss * world).backward()
        total += loss.item()
    return summed_grads(model, total)


# a rank's 1 prompt x 2 rollouts a step, HF sampling; critic warm-up 1: the policy steps at step 2 only
GAE_ARGS = "--config configs/tiny_cpu.yaml configs/ppo.yaml --max-steps 2 --group-size 2 --rollout hf".split()
GAE_ARGS += (
    "--prompts-per-step 2 --micro-batch-size 2 --no-save --save-every 1 --keep-last 0".split()
)
GAE_ARGS += ["--critic-warmup", "1", "--val-data", ""]


def critic_worker(out, model_dir, data_dir, gae_model):
    """In worker (torchrun): the critic's gradients of rank r's rows [4r, 4r + 4) in micro-batches of 2, then a
    2-step gae run of gae_model (critic warm-up 1: the policy steps at step 2 only; a checkpoint each step) and the
    same run resumed from its step 1 in another folder."""
    from conftest import tiny_config
    from train import build_critic, init_dist, load_config, main

    rank, world, device = init_dist()
    critic = build_critic(tiny_config(model=model_dir), device)
    processor, rollouts, adv, _ = model_batch(model_dir, data_dir)
    rows = slice(4 * rank, 4 * rank + 4)
    loss, grads = critic_grads(critic.model, processor, rollouts[rows], adv[rows], 2)
    if rank == 0:
        torch.save((torch.tensor(loss), grads), os.path.join(out, "critic_grads.pt"))
    del critic
    args = GAE_ARGS + ["--model", gae_model, "--train-data", f"{data_dir}/train.jsonl"]
    args += ["--cache-dir", os.path.join(out, "frames")]
    main(load_config(args + ["--out-dir", os.path.join(out, "gae")]))
    step1 = os.path.join(out, "gae", "ckpt", "step_00000001")
    main(load_config(args + ["--out-dir", os.path.join(out, "gae_resumed"), "--resume", step1]))


@pytest.mark.slow
def test_critic_gradients_two_ranks_match_one_process(tiny_model, algo_data, torchrun_job):
    from conftest import tiny_config
    from train import build_critic

    critic = build_critic(tiny_config(model=tiny_model), torch.device("cpu"))
    processor, rollouts, adv, _ = model_batch(tiny_model, algo_data)
    ref = critic_grads(critic.model, processor, rollouts, adv, 8)
    loss, grads = torch.load(torchrun_job / "critic_grads.pt", weights_only=True)
    assert_same(ref, (loss.item(), grads))
    assert (
        "value_head.weight" in grads
        and grads["model.language_model.layers.0.mlp.up_proj.weight"].abs().max() > 0
    )


def checkpoint_tensors(folder) -> dict:
    """A DCP checkpoint's tensors, flattened: "model/...", "optim/state/...", "critic/...", "critic_optim/..."."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(saved))
    flat = {}

    def walk(prefix, x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, (list, tuple)):
            for k, v in enumerate(x):
                walk(f"{prefix}/{k}", v)
        else:
            flat[prefix] = x

    walk("", torch.load(saved, weights_only=False))
    return flat


@pytest.mark.slow
def test_gae_two_steps_and_resume_bit_exact_qwen3_5(torchrun_job):
    """Qwen3.5 (issue 42): exact resume of a model with linear-attention layers, its critic's too."""
    rows = metrics(torchrun_job, "gae")
    resumed = metrics(torchrun_job, "gae_resumed")
    assert [r["step"] for r in rows] == [1, 2] and [r["step"] for r in resumed] == [2]
    for r in rows:
        assert all(
            math.isfinite(r[k]) for k in ("critic/vf_loss", "critic/grad_norm", "critic/values")
        )
        assert r["critic/grad_norm"] > 0 and r["grad_norm"] > 0
    assert (
        rows[0]["kl"] == 0.0 and rows[1]["kl"] == 0.0
    )  # warm-up: the policy is still the reference
    for k, v in rows[1].items():
        if not k.startswith(("time/", "tokens/s", "cache/")):
            assert resumed[0][k] == v, k
    ckpt = torchrun_job / "gae" / "ckpt"
    first, full = (
        checkpoint_tensors(ckpt / "step_00000001"),
        checkpoint_tensors(ckpt / "step_00000002"),
    )
    again = checkpoint_tensors(torchrun_job / "gae_resumed" / "ckpt" / "step_00000002")
    assert full.keys() == again.keys() and any(k.startswith("/critic_optim/state") for k in full)
    for k in full:
        same = torch.equal(full[k], again[k]) if torch.is_tensor(full[k]) else full[k] == again[k]
        assert same, k
    from transformers import AutoModelForImageTextToText

    qwen3_5 = tiny_model_dir("qwen3_5")
    base = AutoModelForImageTextToText.from_pretrained(qwen3_5, dtype=torch.float32).state_dict()
    w = "model.language_model.layers.0.mlp.up_proj.weight"
    assert torch.equal(
        first[f"/model/{w}"], base[w]
    )  # step 1 (warm-up) did not move the policy ...
    assert not torch.equal(first[f"/critic/{w}"], base[w])  # ... but the critic
    assert not torch.equal(full[f"/model/{w}"], base[w])
    # the policy's AdamW at step 2: one step (not DCP's zero-gradient initialisation in the warm-up save too)
    assert [v for k, v in full.items() if k.startswith("/optim/state/") and k.endswith("/step")][
        0
    ] == 1


def test_memory_plan_holds_the_critic():
    """The critic's weights and AdamW shards: a full critic the policy's sizes (no reference copy), a LoRA critic its
    own frozen base + the adapters' AdamW; nothing without gae."""
    import memory_plan

    spec, real = memory_plan.stored("Qwen/Qwen2.5-VL-7B-Instruct", "bfloat16")
    meas = {
        "decoder": {"plain": {"layer": 0, "rest": 0}, "ckpt": {"layer": 0, "rest": 0}},
        "vision": {"plain": {"layer": 0, "rest": 0}, "ckpt": {"layer": 0, "rest": 0}, "encode": 0},
        "logit_bytes": 0,
        "params": real["params"],
    }
    args = dict(spec=spec, meas=meas, gpus=8, gpu_mem=80 * 2**30, cuda=True, prompt=1000, patches=0)
    for lora_rank in (0, 64):
        cfg = Config(model="Qwen/Qwen2.5-VL-7B-Instruct", lora_rank=lora_rank, max_prompt_len=1000)
        held = memory_plan.plan(dataclasses.replace(cfg, adv_estimator="gae"), **args).held
        critic = next(v for k, v in held.items() if k.startswith("critic"))
        optim = next(v for k, v in held.items() if k.startswith("optimizer"))
        assert (
            critic == held["parameters (fp32 shards, + reference)"] + optim > 0
        )  # kl_coef 0: no reference
        assert (
            next(v for k, v in memory_plan.plan(cfg, **args).held.items() if k.startswith("critic"))
            == 0
        )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    worker(*sys.argv[1:5])

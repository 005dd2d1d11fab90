"""Sequence parallelism (sp.py, issue 14): sp_size ranks hold the shards of the same rows and compute what one
process computes on the whole rows. The torchrun workers are this file run as a script:

    torchrun --nproc_per_node=2 tests/test_sp.py OUT DATA.jsonl 2 qwen2_5_vl qwen3_vl   # sp 2
    torchrun --nproc_per_node=4 tests/test_sp.py OUT DATA.jsonl 2 qwen3_vl              # dp 2 x sp 2

    .venv/bin/python -m pytest -q tests/test_sp.py
"""
import os
import subprocess
import sys

import pytest
import torch

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]
import data  # noqa: E402
import train  # noqa: E402
from conftest import ROOT, tiny_config  # noqa: E402
from rollout import Rollout, vision_token_ids  # noqa: E402

TEMPERATURE, CHUNK = 0.7, 3
BATCHES = [list(range(7)), [4, 5, 6]]  # all rows; image+video x 2 and text (the video split mid-way over 2 ranks)


def model_dir(arch: str) -> str:
    import make_tiny_model
    return make_tiny_model.ensure(arch, root=os.path.join(ROOT, ".cache/models"))


def make_rows(processor, cfg, data_path: str) -> list:
    """7 rows: a video prompt x 2, an image prompt x 2, image+video x 2, text x 1; the longest prompt plus the longest
    response is odd (the sequence does not split evenly over 2 ranks: the last shard holds a padding position)."""
    samples = data.load_samples(data_path)
    video = next(s for s in samples if s.get("videos"))
    image = next(s for s in samples if s.get("images"))
    both = dict(video, id="both", images=image["images"], data_type="video")
    text = dict(video, id="text", videos=[], data_type="text")
    prompts = [data.prepare(s, processor, cfg) for s in (video, image, both, text)]
    longest = 5 - max(len(p.prompt_ids) for p in prompts) % 2  # 4 or 5 response tokens: an odd total
    responses = [[30, 31, 32], [40], [50, 51], list(range(60, 60 + longest)), [70, 71], [], [80, 81]]
    return [Rollout(prompts[k], ids, None, "", "stop") for k, ids in zip([0, 0, 1, 1, 2, 2, 3], responses)]


def weighted_loss(logp, ent, mask, index: list[int]):
    """A loss that weighs every token of every (global) row differently, log-probs and entropy."""
    w = (1 + torch.tensor(index, dtype=torch.float32)[:, None]) * 0.1 + torch.arange(mask.shape[1]) * 0.01
    return -(logp * mask * w).sum() + 0.3 * (ent * mask * w).sum()


def run(arch: str, data_path: str, sp_size: int, layout) -> dict:
    """Per batch of BATCHES: this dp rank's rows, their log-probs and entropy; every parameter's full gradient of the
    summed weighted losses. dp ranks take the rows of a batch round-robin."""
    from transformers import AutoProcessor
    d = model_dir(arch)
    cfg = tiny_config(model=d, sp_size=sp_size)
    processor = AutoProcessor.from_pretrained(d)
    tok = processor.tokenizer
    rows = make_rows(processor, cfg, data_path)
    model = train.load_model(cfg, torch.device("cpu"))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    dummies = data.dummy_prompts(processor) if world > 1 else None
    dp_rank, dp_size = (layout.dp_rank, layout.dp_size) if layout else (0, 1)
    out = {}
    for k, batch in enumerate(BATCHES):
        index = batch[dp_rank::dp_size]
        b = train.collate([rows[i] for i in index], tok.pad_token_id, tok, "cpu", dummies)
        logp, ent = train.token_logp(model, b, TEMPERATURE, vision_token_ids(tok), CHUNK, layout)
        (weighted_loss(logp, ent, b["mask"], index) * world).backward()  # FSDP averages over ranks: x world, a sum
        out.update({f"logp{k}": (logp * b["mask"]).detach(), f"ent{k}": (ent * b["mask"]).detach(),
                    f"index{k}": torch.tensor(index), f"encodes{k}": torch.tensor(b["encodes"]),
                    f"length{k}": torch.tensor(b["input_ids"].shape[1])})
    for n, p in model.named_parameters():  # full_tensor is a collective: every rank calls it
        out["grad." + n] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).contiguous()
    return out


def worker(out_dir: str, data_path: str, sp_size: str, *archs: str):
    from safetensors.torch import save_file

    import sp
    rank, _, _ = train.init_dist()
    layout = sp.make_layout(int(sp_size))
    for arch in archs:
        result = run(arch, data_path, int(sp_size), layout)
        save_file(result, os.path.join(out_dir, f"{arch}.rank{rank}.safetensors"))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def reference(synth):
    """Both checkpoints, one process, the whole rows: what every SP run must reproduce."""
    return {arch: run(arch, os.path.join(synth, "train.jsonl"), 1, None) for arch in ("qwen2_5_vl", "qwen3_vl")}


def torchrun(tmp_path, synth, nproc: int, *args: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
           str(tmp_path), os.path.join(synth, "train.jsonl"), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-6000:]


def check_against(ref: dict, got: list[dict]):
    """Every rank's log-probs/entropy equal the reference rows (fp32, 1e-5); rank 0's gradients equal the reference."""
    for k in range(len(BATCHES)):
        assert ref[f"length{k}"] % 2 == 1 or k  # the first batch's sequence is odd
        for part in got:
            rows = [BATCHES[k].index(i) for i in part[f"index{k}"].tolist()]
            for key in (f"logp{k}", f"ent{k}"):
                want = ref[key][rows][:, :part[key].shape[1]]
                torch.testing.assert_close(part[key], want, rtol=0, atol=1e-5)
    grads = {n: t for n, t in ref.items() if n.startswith("grad.")}
    assert grads.keys() == {n for n in got[0] if n.startswith("grad.")}
    assert any(n.startswith("grad.model.visual.blocks") and g.abs().sum() > 0 for n, g in grads.items())
    for n, g in grads.items():
        torch.testing.assert_close(got[0][n], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=n)


@pytest.mark.slow
def test_sp2_matches_one_process(tmp_path, synth, reference):
    """sp_size 2 on 2 ranks vs one process, both checkpoints: log-probs, entropy and every parameter's gradient
    (fp32); each rank encodes half of the temporal patches (one piece per modality: encodes 2 per batch)."""
    from safetensors.torch import load_file
    torchrun(tmp_path, synth, 2, "2", "qwen2_5_vl", "qwen3_vl")
    for arch, ref in reference.items():
        got = [load_file(tmp_path / f"{arch}.rank{r}.safetensors") for r in range(2)]
        check_against(ref, got)
        assert ref["encodes0"] == 4 and ref["encodes1"] == 2  # one process: 2 images + 2 videos; 1 + 1
        assert all(part[f"encodes{k}"] == 2 for part in got for k in range(2))


@pytest.mark.slow
def test_dp2_sp2_matches_one_process(tmp_path, synth, reference):
    """4 ranks, dp 2 x sp 2: each SP pair takes half of the rows; the pair's log-probs equal the reference rows and
    the gradient equals one process over all rows (Qwen3-VL: deepstack features sliced to the shards)."""
    from safetensors.torch import load_file
    torchrun(tmp_path, synth, 4, "2", "qwen3_vl")
    got = [load_file(tmp_path / f"qwen3_vl.rank{r}.safetensors") for r in range(4)]
    check_against(reference["qwen3_vl"], got)


if __name__ == "__main__":
    worker(*sys.argv[1:])

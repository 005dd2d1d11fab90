"""Worker for tests/test_joint.py: one forward/backward of fixed rollouts; rank 0 writes the full gradients.

    torchrun --nproc_per_node=2 tests/grad_worker.py MODEL DATA.jsonl OUT.safetensors split   # rank 0 image, 1 video
    torchrun --nproc_per_node=2 tests/grad_worker.py MODEL DATA.jsonl OUT.safetensors uneven  # 0 image+video, 1 text
    python tests/grad_worker.py MODEL DATA.jsonl OUT.safetensors                      # reference: all rows, one process
    a 5th argument "ckpt" turns on gradient_checkpointing (composed with FSDP2 on 2 ranks)

Several cases in one launch (the process and torchrun start-up are paid once): comma-separated cases, each a layout
with optional "+ckpt" and "+keep" or "+replicate" (train.Config.fsdp; else reshard), and "{case}" in OUT, e.g.
OUT_DIR/{case}.safetensors with split,uneven,uneven+ckpt (conftest.shared_2_ranks runs worker() so).
"""

import os
import sys

import torch

sys.path[:0] = [
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(os.path.abspath(__file__)),
]
import data  # noqa: E402
import train  # noqa: E402
from conftest import tiny_config  # noqa: E402
from rollout import Rollout, vision_token_ids  # noqa: E402


def main(model_dir, data_path, out, layout="split", ckpt="", fsdp="reshard"):
    from safetensors.torch import save_file
    from transformers import AutoProcessor

    rank, world, device = train.init_dist()
    cfg = tiny_config(model=model_dir, gradient_checkpointing=ckpt == "ckpt", fsdp=fsdp)
    processor = AutoProcessor.from_pretrained(model_dir)
    tok = processor.tokenizer
    samples = data.load_samples(data_path)
    pick = [
        next(s for s in samples if s.get("images")),
        next(s for s in samples if s.get("videos")),
        dict(samples[0], videos=[], images=[], data_type="text"),
    ]
    rollouts = [
        Rollout(data.prepare(s, processor, cfg), ids, None, "", "stop")
        for s, ids in zip(pick, ([30, 31, 32], [40, 41], [50, 51, 52]))
    ]
    parts = {"split": [[0], [1]], "uneven": [[0, 1], [2]]}[layout]
    mine = [rollouts[i] for i in (sum(parts, []) if world == 1 else parts[rank])]
    torch.manual_seed(0)
    model = train.load_model(cfg, device)
    n = sum(len(rollouts[i].response_ids) for i in sum(parts, []))
    b = train.collate(
        mine, tok.pad_token_id, device, data.dummy_prompts(processor) if world > 1 else None
    )
    logp, _ = train.token_logp(model, b, 1.0, vision_token_ids(tok))
    loss = (
        -(logp * b.mask).sum() / n * world
    )  # n response tokens in all; FSDP averages grads over ranks
    loss.backward()
    if world > 1 and fsdp == "replicate":  # as train.optimizer_step: one all-reduce
        train.sum_grads([p for p in model.parameters() if p.requires_grad], loss.item())
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).contiguous()
        for n, p in model.named_parameters()
    }  # full_tensor is a collective: every rank calls it
    if rank == 0:
        save_file(grads, out)
    if world > 1:
        torch.distributed.barrier()


def worker(model_dir, data_path, out, cases="split", ckpt=""):
    """main() once per comma-separated case ("uneven+ckpt+keep": with gradient checkpointing, FSDP2 keeping the
    gathered blocks), into out.format(case=...)."""
    names = cases.split(",")
    if len(names) > 1 and "{case}" not in out:
        raise ValueError(f"several cases ({cases}) need '{{case}}' in the output path, got {out}")
    for name in names:
        layout, *flags = name.split("+")
        fsdp = next((f for f in flags if f in ("keep", "replicate")), "reshard")
        case_ckpt = ckpt
        if "ckpt" in flags:
            case_ckpt = "ckpt"
        main(model_dir, data_path, out.format(case=name), layout, case_ckpt, fsdp)


if __name__ == "__main__":
    worker(*sys.argv[1:6])

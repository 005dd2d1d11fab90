"""SFT throughput (loss_type sft): token-budget micro-batches of length-sorted rows vs fixed-size padded micro-batches
in data order (the trainer's micro_batch_size), on one mixed-length set, in one run.

    .venv/bin/python bench/sft.py          # ~4 min on 2 shared cores (~20 CPU s)

The tiny Qwen2.5-VL (fp32, CPU, one thread); `rows` synthetic color clips, each with a reference response whose
length makes the rows (prompt + response) vary 4x, log-uniformly (many short answers, a tail of long reasoning).
Both settings train the same rows with train.update (forward, backward, AdamW step) on micro-batches
train.split_batch plans and train.collate pads: "padded", `micro_batch` rows in data order; "token budget",
length-sorted rows up to micro_batch x the longest row tokens (the memory the padded setting must provision for its
worst micro-batch). Tokens/s counts real tokens (prompt + response, no padding) per second of this process's CPU
time (the machine's other jobs do not count); each setting's fastest of `rounds` (the first, a warm-up, left out).
"""

import os
import random
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


@dataclass
class Config:
    rows: int = 96
    """samples (clips) in the set"""
    micro_batch: int = 8
    """rows per padded micro-batch (micro_batch_size)"""
    shortest: int = 128
    """the shortest row in tokens; the longest is 4x"""
    rounds: int = 3
    """passes over the set per setting, alternating (the first is a warm-up)"""
    out: str = os.path.join(ROOT, ".cache/bench/sft")
    """the clips go here"""


def rollouts(c: Config, processor) -> list:
    """The set: one color clip per row, its reference response random text tokens, the row lengths log-uniform
    in [shortest, 4 x shortest]."""
    import data
    import make_synthetic_data
    import train
    from rollout import Rollout, vision_token_ids

    make_synthetic_data.make(
        c.out, ["color"], num_train=c.rows, num_val=1, seed=0, size=56, fps=4, seconds=2.0
    )
    samples = data.load_samples(os.path.join(c.out, "train.jsonl"))
    cfg = train.Config(
        video_min_pixels=3136, video_max_pixels=3136, cache_dir="", video_source="decode_only"
    )
    special = set(processor.tokenizer.all_special_ids) | set(vision_token_ids(processor.tokenizer))
    words = [i for i in range(len(processor.tokenizer)) if i not in special]
    rng = random.Random(0)
    out = []
    for s in samples:
        p = data.prepare(s, processor, cfg.media())
        total = round(c.shortest * 4 ** rng.random())
        ids = rng.choices(words, k=total - len(p.prompt_ids))
        out.append(Rollout(p, ids, None, "", "offline"))
    return out


def main(c: Config):
    import sp
    import train
    from transformers import AutoProcessor

    torch.manual_seed(0)
    torch.set_num_threads(1)  # CPU time measures the work alone
    longest = 4 * c.shortest
    cfg = train.Config(
        loss_type="sft", group_size=1, max_response_len=longest, lr=1e-5, logp_chunk=0
    )
    processor = AutoProcessor.from_pretrained(cfg.model)
    t = train.build_trainer(cfg, processor, sp.make_layout(1), torch.device("cpu"))
    rows = rollouts(c, processor)
    lengths = [len(r.prompt.prompt_ids) + len(r.response_ids) for r in rows]
    budget = c.micro_batch * max(lengths)
    plans = {
        f"padded, {c.micro_batch} rows in data order": train.split_batch(rows, 1, c.micro_batch)[0],
        f"token budget {budget}, length-sorted": train.split_batch(
            rows, 1, len(rows), budget, by_length=True
        )[0],
    }
    best = {name: float("inf") for name in plans}
    for k in range(c.rounds):
        for name, plan in plans.items():
            t0 = time.process_time()
            batches = [train.collate([rows[j] for j in mb], 0, "cpu") for mb in plan]
            train.update(t, [batches], cfg, step=1, ids=[])
            if k:  # the first round warms up
                best[name] = min(best[name], time.process_time() - t0)
    real = sum(lengths)
    print(
        f"{len(rows)} rows of {min(lengths)}-{max(lengths)} tokens ({real} in all), tiny model, CPU"
    )
    print("| micro-batches | count | padded tokens | real / padded | CPU s | tokens/s |")
    print("|---|---|---|---|---|---|")
    speed = {}
    for name, plan in plans.items():
        # collate pads the prompts on the left, the responses on the right
        prompt = [max(len(rows[j].prompt.prompt_ids) for j in mb) for mb in plan]
        response = [max(len(rows[j].response_ids) for j in mb) for mb in plan]
        padded = sum(len(mb) * (p + r) for mb, p, r in zip(plan, prompt, response))
        speed[name] = real / best[name]
        print(
            f"| {name} | {len(plan)} | {padded} | {real / padded:.2f} | {best[name]:.2f} "
            f"| {speed[name]:.0f} |"
        )
    fixed, budgeted = speed.values()
    print(f"sft tokens/s vs padded batches: {budgeted / fixed:.2f}x")


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))

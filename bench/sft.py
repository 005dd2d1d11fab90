"""SFT throughput (loss_type sft): token-budget micro-batches of length-sorted rows vs fixed-size padded micro-batches
in data order (the trainer's micro_batch_size), on one mixed-length set, in one run.

    .venv/bin/python bench/sft.py          # ~4 min on 2 shared cores (~20 CPU s)

The tiny Qwen2.5-VL (fp32, CPU, one thread); ROWS synthetic color clips, each with a reference response whose
length makes the rows (prompt + response) vary 4x, log-uniformly (many short answers, a tail of long reasoning).
Both settings train the same rows with train.update (forward, backward, AdamW step) on micro-batches
train.split_batch plans and train.collate pads: "padded", MICRO_BATCH rows in data order; "token budget",
length-sorted rows up to MICRO_BATCH x the longest row tokens (the memory the padded setting must provision for its
worst micro-batch). Tokens/s counts real tokens (prompt + response, no padding) per second of this process's CPU
time (the machine's other jobs do not count); each setting's fastest of ROUNDS (the first, a warm-up, left out).
"""

import os
import random
import time

import torch

from harness import ROOT

ROWS = 96  # samples (clips) in the set
MICRO_BATCH = 8  # rows per padded micro-batch (micro_batch_size)
SHORTEST = 128  # the shortest row in tokens; the longest is 4x
ROUNDS = 3  # passes over the set per setting, alternating (the first is a warm-up)
OUT = os.path.join(ROOT, ".cache/bench/sft")  # the clips go here


def rollouts(processor) -> list:
    """The set: one color clip per row, its reference response random text tokens, the row lengths log-uniform
    in [shortest, 4 x shortest]."""
    import data
    import make_synthetic_data
    import train
    from rollout import Rollout, vision_token_ids

    make_synthetic_data.make(OUT, ["color"], num_train=ROWS, num_val=1)  # 56x56, 4 fps, 2 s
    samples = data.load_samples(os.path.join(OUT, "train.jsonl"))
    cfg = train.Config(video_max_pixels=3136, cache_dir="", video_source="decode_only")
    special = set(processor.tokenizer.all_special_ids) | set(vision_token_ids(processor.tokenizer))
    words = [i for i in range(len(processor.tokenizer)) if i not in special]
    rng = random.Random(0)
    out = []
    for s in samples:
        p = data.prepare(s, processor, cfg.media())
        total = round(SHORTEST * 4 ** rng.random())
        ids = rng.choices(words, k=total - len(p.prompt_ids))
        out.append(Rollout(p, ids, None, "", "offline"))
    return out


def main():
    import sp
    import train
    from transformers import AutoProcessor

    torch.manual_seed(0)
    torch.set_num_threads(1)  # CPU time measures the work alone
    cfg = train.Config(
        loss_type="sft", group_size=1, max_response_len=4 * SHORTEST, lr=1e-5, logp_chunk=0
    )
    processor = AutoProcessor.from_pretrained(cfg.model)
    t = train.build_trainer(cfg, processor, sp.make_layout(1), torch.device("cpu"))
    rows = rollouts(processor)
    lengths = [len(r.prompt.prompt_ids) + len(r.response_ids) for r in rows]
    budget = MICRO_BATCH * max(lengths)
    plans = {
        f"padded, {MICRO_BATCH} rows in data order": train.split_batch(rows, 1, MICRO_BATCH)[0],
        f"token budget {budget}, length-sorted": train.split_batch(
            rows, 1, len(rows), budget, by_length=True
        )[0],
    }
    best = {name: float("inf") for name in plans}
    padded = {}
    for k in range(ROUNDS):
        for name, plan in plans.items():
            t0 = time.process_time()
            batches = [train.collate([rows[j] for j in mb], 0, "cpu") for mb in plan]
            for b in batches:  # the loss normalizers, as train.micro_batches sets them
                b.n_tok = sum(len(r.response_ids) for r in rows)
                b.n_seq = len(rows)
            train.update(t, [batches], cfg, step=1, ids=[])
            if k:  # the first round warms up
                best[name] = min(best[name], time.process_time() - t0)
            padded[name] = sum(
                b.input_ids.numel() for b in batches
            )  # prompts left-, responses right-padded
    real = sum(lengths)
    print(
        f"{len(rows)} rows of {min(lengths)}-{max(lengths)} tokens ({real} in all), tiny model, CPU"
    )
    print("| micro-batches | count | padded tokens | real / padded | CPU s | tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, plan in plans.items():
        print(
            f"| {name} | {len(plan)} | {padded[name]} | {real / padded[name]:.2f} | {best[name]:.2f} "
            f"| {real / best[name]:.0f} |"
        )
    fixed, budgeted = best.values()
    print(f"sft tokens/s vs padded batches: {fixed / budgeted:.2f}x")


if __name__ == "__main__":
    main()

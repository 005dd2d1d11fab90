"""Build tiny random-weight Qwen2.5-VL / Qwen3-VL checkpoints locally (no hub, no network).

    python scripts/make_tiny_model.py --arch qwen2_5_vl --out .cache/models/tiny-qwen2_5_vl [--seed 0]
    python scripts/make_tiny_model.py --arch qwen3_vl   --out .cache/models/tiny-qwen3_vl

What makes them "real enough": HF format written by save_pretrained, the real model classes, a byte-level
BPE tokenizer (trained here on a small corpus) holding the Qwen special tokens plus <think>/<answer>, the
Qwen chat template shape, and the image/video processors with the real patch sizes (14 for Qwen2.5-VL,
16 for Qwen3-VL; merge 2, temporal patch 2). Sizes: text hidden 128, 2 layers, 2 heads of dim 64 (vLLM's
CPU attention kernel rejects head_dim 16), 1 KV head; vision depth 2, hidden 64. Deterministic by seed.
"""
import argparse
import json
import os
import shutil

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
           "<|image_pad|>", "<|video_pad|>"]
ADDED = ["<think>", "</think>", "<answer>", "</answer>"]  # plain added tokens: they survive skip_special_tokens
CHAT_TEMPLATE = (  # the Qwen2.5-VL template's shape (Qwen3-VL: the same without the default system turn)
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' and DEFAULT_SYSTEM %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS_WORDS = ("what is the background color of the video image red green blue yellow white gray black square circle "
                "shape shapes move moves moving left right up down direction which how many are there in when does "
                "appear disappear start end time seconds answer with option letter number single final put your inside "
                "tags options you a helpful assistant user system watch then frame frames count counting yes no true "
                "false box boxes the of and to it at from first last one two three four five").split()


def train_tokenizer(seed: int):
    """A ~450-token byte-level BPE over task-like text; every byte is reachable, so any text round-trips."""
    import random
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(CORPUS_WORDS) for _ in range(12)) + f" {rng.randint(0, 999)}.{rng.randint(0, 99)}"
             for _ in range(3000)]
    lines += ['{"time": [1.25, 3.5]}', '{"boxes": [10, 20, 30, 40]}', "A. red\nB. green\nC. blue\nD. yellow"] * 50
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=448, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(lines, trainer)
    return tk


def build(arch: str, out: str, seed: int = 0, force: bool = False) -> str:
    """Write the checkpoint to `out` (via out.tmp + rename, marker written last). Idempotent."""
    import torch
    from transformers import AddedToken, PreTrainedTokenizerFast
    if os.path.exists(os.path.join(out, "DONE")) and not force:
        return out
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(seed), bos_token=None, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None, additional_special_tokens=SPECIAL[3:],
                                  clean_up_tokenization_spaces=False)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    vocab = (len(tok) + 63) // 64 * 64  # padded like real checkpoints; vLLM shards the embedding by 64s
    qwen3 = arch == "qwen3_vl"
    template = CHAT_TEMPLATE.replace("DEFAULT_SYSTEM", "false" if qwen3 else "true")
    tok.chat_template = template
    text = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=128, initializer_range=0.02)
    if qwen3:
        from transformers import (Qwen3VLConfig as Cfg, Qwen3VLForConditionalGeneration as Model,
                                  Qwen3VLProcessor as Proc, Qwen3VLVideoProcessor as VidProc)
        text["rope_parameters"] = dict(rope_type="default", rope_theta=5e5, mrope_section=[12, 10, 10], mrope_interleaved=True)
        vision.update(patch_size=16, num_position_embeddings=256, deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh")
    else:
        from transformers import (Qwen2_5_VLConfig as Cfg, Qwen2_5_VLForConditionalGeneration as Model,
                                  Qwen2_5_VLProcessor as Proc, Qwen2VLVideoProcessor as VidProc)
        text["rope_parameters"] = dict(rope_type="default", rope_theta=1e6, mrope_section=[8, 12, 12])
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)
    from transformers import Qwen2VLImageProcessor as ImgProc
    factor = vision["patch_size"] * 2
    config = Cfg(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    torch.manual_seed(seed)
    model = Model(config).to(torch.float32)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.do_sample = False
    # tiny frames (2x2 merged tokens) must not be upscaled: min 4*factor^2 pixels, max 1024*factor^2
    size = {"shortest_edge": 4 * factor * factor, "longest_edge": 1024 * factor * factor}
    common = dict(size=size, patch_size=vision["patch_size"], merge_size=2, temporal_patch_size=2)
    image_proc = ImgProc(**common)
    video_proc = VidProc(**common)
    processor = Proc(image_processor=image_proc, tokenizer=tok, video_processor=video_proc, chat_template=template)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    with open(os.path.join(tmp, "DONE"), "w") as f:
        json.dump({"arch": arch, "seed": seed}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def ensure(arch: str, root: str = ".cache/models", seed: int = 0) -> str:
    """The tiny checkpoint folder for `arch`, built first if missing."""
    return build(arch, os.path.join(root, f"tiny-{arch}"), seed)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["qwen2_5_vl", "qwen3_vl"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    print(build(a.arch, a.out, a.seed, a.force))

"""Build tiny random-weight Qwen2-VL / 2.5-VL / 3-VL (dense, MoE) / 3.5 (dense, MoE) / 2.5-Omni / 3-Omni (MoE)
checkpoints (no hub, no network).

    python scripts/make_tiny_model.py --arch qwen3_vl --out .cache/models/tiny-qwen3_vl [--seed 0] [--force]

Real but for their sizes (build below): save_pretrained's fp32 safetensors, the real model classes, processors, patch
sizes and chat templates, a byte-level BPE tokenizer (Qwen2Tokenizer; Qwen3.5: Qwen3_5Tokenizer) trained here (the
same for every seed) with Qwen's special tokens plus <think>/<answer>. The newer families: docs/families.md.
Text: hidden 128, 2 layers, 2 heads of dim 64 (vLLM's CPU attention rejects 16).
The "wide" variant (tiny-<arch>-wide): hidden 384, 6 query / 2 KV heads (sequence parallelism over 3 ranks repeats
KV heads, over 4 pads zero heads) and Qwen2.5-VL windows of one merged token (several windows per frame).
The "heads<Q>-<KV>" variants: a published model's query / KV heads at width 64 (hidden 64 x Q), 2 layers, for
scripts/rehearse.py (Qwen2.5-VL and Qwen3-VL: Qwen2-VL's tower names its output width otherwise).
"""

import json
import os
import shutil
from typing import Literal

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# the placeholder and bracket tokens' names (the Omni processor reads them from its tokenizer)
VL_TOKENS = dict(
    image_token="<|image_pad|>",
    video_token="<|video_pad|>",
    vision_bos_token="<|vision_start|>",
    vision_eos_token="<|vision_end|>",
)
ADDED = [
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
]  # added but not special: they survive skip_special_tokens
WIDTHS = dict(
    hidden_size=64, intermediate_size=128, out_hidden_size=128
)  # Qwen2.5/3-VL towers: width, MLP, merger
# What differs between the architectures: the transformers classes (config, model, processor, video processor), the
# real patch size (x spatial merge 2 = 28 / 32 pixels per visual token side) and the settings the tiny sizes scale down
ARCHS = {
    "qwen2_vl": dict(
        classes=(
            "Qwen2VLConfig",
            "Qwen2VLForConditionalGeneration",
            "Qwen2VLProcessor",
            "Qwen2VLVideoProcessor",
        ),
        patch=14,
        rope=dict(rope_type="default", rope_theta=1e6, mrope_section=[8, 12, 12]),  # real / 2
        # its own schema: width embed_dim, MLP mlp_ratio x wider (quick GELU, no gate), hidden_size the merger's output
        # (the text width); full attention in every block, no time scale in M-RoPE (one position per frame pair)
        vision=dict(embed_dim=64, mlp_ratio=2, hidden_size=128, hidden_act="quick_gelu"),
        norm={},  # the CLIP mean/std defaults
    ),
}
# Qwen2.5-VL: Qwen2-VL's patch, positions and normalization. Its tower (and Qwen2.5-Omni's): window attention over
# 56px = 2x2 merged tokens, full attention in the last block (real: 112px, every 8th)
WINDOWED = dict(window_size=56, fullatt_block_indexes=[1], hidden_act="silu", **WIDTHS)
ARCHS["qwen2_5_vl"] = ARCHS["qwen2_vl"] | dict(
    classes=(
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLProcessor",
        "Qwen2VLVideoProcessor",
    ),
    vision=WINDOWED | dict(tokens_per_second=2),
)
ARCHS["qwen3_vl"] = dict(
    classes=(
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLProcessor",
        "Qwen3VLVideoProcessor",
    ),
    patch=16,
    # real: mrope_section [24, 20, 20] of head_dim/2 = 64, interleaved (THWTHW...); ours halves it to 32
    rope=dict(
        rope_type="default", rope_theta=5e6, mrope_section=[12, 10, 10], mrope_interleaved=True
    ),
    # deepstack: features after vision block 0 are also added into decoder layer 0 (indexes must be < depth)
    vision=dict(
        num_position_embeddings=256,
        deepstack_visual_indexes=[0],
        hidden_act="gelu_pytorch_tanh",
        **WIDTHS,
    ),
    norm=dict(image_mean=[0.5] * 3, image_std=[0.5] * 3),  # normalized to [-1, 1]
)
# Qwen3-VL-MoE: Qwen3-VL's tower, positions, processor and template (Qwen3-VL-30B-A3B-Instruct ships the 8B's) with
# a sparse MLP in every decoder layer: 4 experts, top 2 (real: 128, top 8), no shared expert (the family has none)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
QWEN3_VL_PROCESSORS = ARCHS["qwen3_vl"]["classes"][2:]  # the newer families' (Qwen3.5's too)
ARCHS["qwen3_vl_moe"] = ARCHS["qwen3_vl"] | dict(
    classes=("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration") + QWEN3_VL_PROCESSORS,
    # top-k weights renormalized, as transformers always does; vLLM reads the flag (5.19 has no field)
    text=MOE | dict(norm_topk_prob=True),
    template="qwen3_vl",
)
# Qwen3.5: natively multimodal, Qwen3-VL's processors, no deepstack; a gated delta-net (linear attention) layer
# then a full attention layer (real: 3 linear per full one); rotary on a quarter of each head (64 x 0.25 = 16:
# mrope_section sums to 8; real: 256 x 0.25, [11, 11, 10]); its own tokenizer class (pre-tokenizer regex)
ARCHS["qwen3_5"] = ARCHS["qwen3_vl"] | dict(  # its patch and normalization
    classes=("Qwen3_5Config", "Qwen3_5ForConditionalGeneration") + QWEN3_VL_PROCESSORS,
    rope=dict(
        rope_type="default",
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        mrope_section=[3, 3, 2],
        mrope_interleaved=True,
    ),
    vision=dict(num_position_embeddings=256, hidden_act="gelu_pytorch_tanh", **WIDTHS),
    text=dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # real: twice the key heads too
        linear_key_head_dim=128,  # the real width: vLLM's CPU kernel rejects 32
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    ),
    tokenizer="Qwen3_5Tokenizer",
)
# Qwen2.5-Omni: the published layout (Qwen2_5OmniForConditionalGeneration's config and "thinker." weights, no talker:
# enable_audio_output off; vLLM serves that class's thinker), Qwen2.5-VL's tower and positions with the Omni token
# names, a Whisper-like audio tower (real: 32 layers of width 1280 over 128 mel bins) and its feature extractor
ARCHS["qwen2_5_omni"] = ARCHS["qwen2_5_vl"] | dict(
    classes=(
        "Qwen2_5OmniConfig",
        "Qwen2_5OmniForConditionalGeneration",
        "Qwen2_5OmniProcessor",
        "Qwen2VLVideoProcessor",
    ),
    vision=WINDOWED,  # no tokens_per_second: the thinker's position_id_per_seconds
    # the thinker's settings beside the text and vision configs: its audio tower's
    thinker=dict(
        audio_config=dict(
            encoder_layers=2,
            encoder_attention_heads=2,
            encoder_ffn_dim=128,
            d_model=64,
            output_dim=128,
        )
    ),
    # the tokenizer's named tokens, which the Omni processor reads
    tokens=dict(
        image_token="<|IMAGE|>",
        video_token="<|VIDEO|>",
        vision_bos_token="<|vision_bos|>",
        vision_eos_token="<|vision_eos|>",
        audio_token="<|AUDIO|>",
        audio_bos_token="<|audio_bos|>",
        audio_eos_token="<|audio_eos|>",
    ),
)
# Qwen3-Omni's MoE thinker: the published layout as Qwen2.5-Omni's (talker and code2wav off), Qwen3-VL's tower and
# interleaved M-RoPE, Qwen3-VL-MoE's sparse MLP, the Qwen-VL placeholders plus <|audio_pad|>, 13 positions per second
# (the real config's; transformers' default 25 is Qwen2.5-Omni's), a Whisper-like audio tower with a conv stem
# (downsample_hidden_size; real: 480). Its template: Qwen3-VL's, which renders our video + text prompts as
# Qwen3-Omni-30B-A3B-Instruct's chat_template.json does (not found verbatim in the reference stores: replace it)
ARCHS["qwen3_omni_moe"] = ARCHS["qwen3_vl_moe"] | dict(
    classes=(
        "Qwen3OmniMoeConfig",
        "Qwen3OmniMoeForConditionalGeneration",
        "Qwen3OmniMoeProcessor",
        "Qwen2VLVideoProcessor",
    ),
    rope=ARCHS["qwen3_vl"]["rope"] | dict(rope_theta=1e6),
    # vLLM sizes the position table from image_size (16 patches a side: num_position_embeddings'; real: 768)
    vision=ARCHS["qwen3_vl"]["vision"] | dict(image_size=256, apply_vit_abs_pos_embed=True),
    # at init 0.02 the conv stem's output is ~1e-3 of the sinusoidal positions it is added to: every sound encodes
    # alike (features 2e-4 apart for two pitches; 0.05: 9e-3, as Qwen2.5-Omni's tower at 0.02)
    thinker=dict(
        audio_config=ARCHS["qwen2_5_omni"]["thinker"]["audio_config"]
        | dict(downsample_hidden_size=32, initializer_range=0.05),
        position_id_per_seconds=13,
    ),
    tokens=VL_TOKENS
    | dict(
        audio_token="<|audio_pad|>",
        audio_bos_token="<|audio_start|>",
        audio_eos_token="<|audio_end|>",
    ),
)
# Qwen3.5-MoE: Qwen3.5 with a sparse MLP (4 experts, top 2; real: 256, top 8) plus its shared expert
ARCHS["qwen3_5_moe"] = ARCHS["qwen3_5"] | dict(
    classes=("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration") + QWEN3_VL_PROCESSORS,
    text=ARCHS["qwen3_5"]["text"] | MOE | dict(shared_expert_intermediate_size=64),
    template="qwen3_5",
)
# variant -> what it changes: the text config, the vision config (the settings the arch has)
VARIANTS = {
    "": ({}, {}),
    "wide": (
        dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2),
        dict(out_hidden_size=384, window_size=28),
    ),
}
# a published model's query / KV head counts at head width 64 (scripts/rehearse.py: vLLM's tensor-parallel rules
# and Ulysses' padding as on the real model): Qwen2.5-VL-7B / Qwen2-VL-7B, Qwen2.5-VL-3B, Qwen3-VL-8B
VARIANTS |= {
    f"heads{q}-{kv}": (
        dict(hidden_size=64 * q, num_attention_heads=q, num_key_value_heads=kv),
        dict(out_hidden_size=64 * q),
    )
    for q, kv in ((28, 4), (16, 2), (32, 8))
}
# the config's token id fields -> the tokenizer's token names (audio: the Omni archs only)
TOKEN_IDS = dict(
    image_token_id="image_token",
    video_token_id="video_token",
    vision_start_token_id="vision_bos_token",
    vision_end_token_id="vision_eos_token",
    audio_token_id="audio_token",
    audio_start_token_id="audio_bos_token",
    audio_end_token_id="audio_eos_token",
)
VERSION = 2  # bump whenever the output changes: ensure() then rebuilds stale caches
MARKER = "DONE"  # written last: its presence (with matching arch/seed/version) means the checkpoint is complete

# The real Instruct checkpoints' chat templates, verbatim: <arch>.jinja
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
# the repository's checkpoints (ensure's default): the tests', benches' and scripts' tiny models
MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache/models")


def corpus() -> list[str]:
    """Text shaped like our prompts and answers, so the ~180 merges are spent on words we actually use."""
    import random

    rng = random.Random(0)  # fixed: the tokenizer must not depend on the weight seed
    colors = "red green blue yellow white black gray orange purple pink".split()
    shapes = "square circle triangle box dot ball".split()
    dirs = "left right up down".split()
    nums = "zero one two three four five six seven eight nine ten".split()
    lines = [
        "You are a helpful assistant.",
        "system",
        "user",
        "assistant",
        "A. red\nB. green\nC. blue\nD. yellow",
        "Answer with the option's letter from the given choices directly.",
        "Output the thinking process in <think> </think> and the final answer in <answer> </answer> tags.",
    ]
    for _ in range(400):
        c = rng.choice(colors)
        s = rng.choice(shapes)
        d = rng.choice(dirs)
        n = rng.choice(nums)
        t0 = round(rng.uniform(0, 9), 1)
        t1 = round(t0 + rng.uniform(0.5, 5), 1)
        opts = rng.sample(colors, 4)
        lines += [
            f"What is the background color of the video? A. {opts[0]} B. {opts[1]} C. {opts[2]} D. {opts[3]}",
            f"Which direction does the {c} {s} move? Options: A. {dirs[0]} B. {dirs[1]} C. {dirs[2]} D. {dirs[3]}",
            f"How many {s}s are there in the video? There are {n} {s}s, {rng.randint(0, 12)} in all.",
            f"When does the {c} {s} appear? Give the start and end time in seconds.",
            (
                f"<think>The {c} {s} moves {d} from frame {rng.randint(0, 31)} to frame {rng.randint(0, 31)}.</think>"
                f"<answer>{rng.choice('ABCD')}</answer>"
            ),
            f'<answer>{{"time": [{t0}, {t1}]}}</answer> <{t0} seconds> {rng.randint(0, 999)}, {rng.random():.3f}',
        ]
    return lines


def make_tokenizer(template: str, Tok, special: list[str], named: dict):
    """A Tok (Qwen2Tokenizer; Qwen3.5: Qwen3_5Tokenizer) whose vocab/merges we train with Qwen's own pipeline (NFC,
    digit-splitting regex, byte-level), so Tok rebuilding it from vocab+merges at load time gives the very tokenizer
    we trained. Byte-level with the full byte alphabet: any text round-trips."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    # borrow its normalizer / pre-tokenizer / decoder instead of copying the regex
    template_tok = Tok()
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        setattr(tk, part, getattr(template_tok.backend_tokenizer, part))
    trainer = trainers.BpeTrainer(
        vocab_size=448,
        special_tokens=special,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(corpus(), trainer)
    model = json.loads(tk.to_str())["model"]
    tok = Tok(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=special[1:],
        clean_up_tokenization_spaces=False,
        errors="replace",
        model_max_length=32768,
        **named,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.chat_template = template
    return tok


def _marker(arch: str, seed: int, variant: str) -> dict:
    return {"arch": arch, "seed": seed, "version": VERSION} | (
        {"variant": variant} if variant else {}
    )


def _complete(out: str, arch: str, seed: int, variant: str) -> bool:
    try:
        with open(os.path.join(out, MARKER)) as f:
            return json.load(f) == _marker(arch, seed, variant)
    except (OSError, ValueError):
        return False


def build(
    arch: Literal[tuple(ARCHS)],  # ARCHS' names (a tuple in Literal[...] is its members)
    out: str,
    seed: int = 0,
    force: bool = False,
    variant: Literal[tuple(VARIANTS)] = "",
) -> str:
    """Write the checkpoint to `out`; returns `out`. Idempotent: a complete checkpoint of the same arch/seed/version
    is kept as is (force: rebuilt). Built in a private temp dir and renamed into place, so readers never see a
    half-written one."""
    spec = ARCHS[arch]
    out = os.path.normpath(out)  # a trailing slash would put the temp dir inside OUT
    if not force and _complete(out, arch, seed, variant):
        return out
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, MARKER)):
        raise FileExistsError(
            f"{out} is not empty and holds no checkpoint of ours: not replacing it"
        )
    import torch
    import transformers

    Cfg, Model, Proc, VidProc = (getattr(transformers, name) for name in spec["classes"])
    named = spec.get("tokens", {})
    special = SPECIAL
    if named:
        special = SPECIAL[:3] + list(named.values())
    with open(os.path.join(TEMPLATES, f"{spec.get('template', arch)}.jinja")) as f:
        Tok = getattr(transformers, spec.get("tokenizer", "Qwen2Tokenizer"))
        tok = make_tokenizer(f.read(), Tok, special, named)
    names = VL_TOKENS | named  # the Qwen-VL token names unless the arch has its own
    ids = {
        field: tok.convert_tokens_to_ids(names[t]) for field, t in TOKEN_IDS.items() if t in names
    }
    patch = spec["patch"]
    text = (
        dict(
            vocab_size=len(
                tok
            ),  # exact: no unused rows a sampler could pick (vLLM pads its shards itself)
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,  # <|im_end|>
            pad_token_id=tok.pad_token_id,  # <|endoftext|>
            dtype="float32",
            rope_parameters=spec["rope"],
        )
        | spec.get("text", {})
        | VARIANTS[variant][0]
    )
    vision = dict(
        depth=2,
        num_heads=2,
        patch_size=patch,
        **spec["vision"],
    )
    vision |= {
        k: v for k, v in VARIANTS[variant][1].items() if k in vision
    }  # the settings this arch has
    config = dict(text_config=text, vision_config=vision, **ids)
    extractor = {}
    if "thinker" in spec:  # the thinker's config inside the Omni one; audio output (the talker) off
        # Qwen2.5-Omni maps the *_token_id names to its *_token_index fields
        config = dict(thinker_config=config | spec["thinker"], enable_audio_output=False)
        # Whisper's log-mel features (128 bins, as the real checkpoint's)
        extractor = dict(feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128))
    config = Cfg(**config, dtype="float32")
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = Model(config).to(torch.float32).eval()
    gen = model.generation_config
    gen.eos_token_id = [
        tok.eos_token_id,
        tok.pad_token_id,
    ]  # like the real checkpoints: stop on either
    gen.pad_token_id = tok.pad_token_id
    # Our frames are tiny (2x2 merged tokens each): the processors' default minimums (56x56 for images,
    # 128 tokens for videos) would upscale them. Floor at 4 merged tokens, cap at 1024.
    factor = patch * 2
    size = {"shortest_edge": 4 * factor * factor, "longest_edge": 1024 * factor * factor}
    common = dict(
        size=size, patch_size=patch, **spec["norm"]
    )  # merge_size 2, temporal_patch_size 2
    # cap_pixels_per_frame: pin the reference (qwen-vl-utils) video budget, transformers' default from v5.22 on
    processor = Proc(
        **extractor,
        image_processor=transformers.Qwen2VLImageProcessor(**common),
        tokenizer=tok,
        video_processor=VidProc(**common, cap_pixels_per_frame=True),
        chat_template=tok.chat_template,
    )

    tmp = f"{out}.tmp-{os.getpid()}"  # private: concurrent builders (e.g. several ranks) never share a temp dir
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if arch == "qwen3_vl_moe":  # transformers saved its own layout: ckpt.published_layout's
        from safetensors.torch import load_file, save_file

        file = os.path.join(tmp, "model.safetensors")
        state = load_file(file)
        state = {
            k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in state.items()
        }
        save_file(state, file, metadata={"format": "pt"})
    processor.save_pretrained(tmp)
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(_marker(arch, seed, variant), f)
    if not force and _complete(
        out, arch, seed, variant
    ):  # someone else finished the same build meanwhile
        shutil.rmtree(tmp)
        return out
    old = f"{out}.old-{os.getpid()}"
    if os.path.exists(out):
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def ensure(arch: str, root: str = MODELS, seed: int = 0, variant: str = "") -> str:
    """`root/tiny-<arch>` (a variant: tiny-<arch>-<variant>), built first if missing or stale."""
    return build(
        arch,
        os.path.join(root, "-".join(["tiny", arch] + [variant] * bool(variant))),
        seed,
        variant=variant,
    )


if __name__ == "__main__":
    import tyro

    print(tyro.cli(build))

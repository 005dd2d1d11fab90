"""Does a train.py config fit in GPU memory? Per-GPU memory of the train and generation phases, before anything runs.

    .venv/bin/python scripts/memory_plan.py --config configs/qwen2_5_vl_7b.yaml --gpus 8 --gpu-mem-gib 80
    .venv/bin/python scripts/memory_plan.py --config configs/qwen3_vl_8b.yaml --frames 128 --tokens 32768
    .venv/bin/python scripts/memory_plan.py --config configs/qwen3_vl_8b.yaml --remeasure   # minutes

The model of train.py: FSDP2 over the `gpus` ranks keeps fp32 master weights, fp32 gradients and AdamW's two fp32
moments, each 1/gpus per GPU (`offload`: in CPU RAM instead); the root module (embeddings, lm_head, vision merger) is
gathered in bf16 with its bf16 gradients for the whole step, one decoder layer or vision block at a time besides
(two: FSDP2 prefetches the next). vLLM holds gpu_memory_utilization x memory while it generates and sleeps in the
train phase (vllm_sleep). The train phase peaks in the largest micro-batch: its decoder activations, its vision
tower activations (one encode per distinct video, none with freeze_vision), the lm_head logits of a chunk of
response positions, and the vision features kept for the step. 10% of the GPU is kept for the CUDA context, NCCL
and allocator fragmentation. The longest prompt is a video of video_max_frames frames of a `video_hw` source at the
largest size the frame settings allow, run through the model's processor (the tiny checkpoint's for a hub name:
same patch, merge and temporal sizes; its tokenizer spends a few more tokens on the text).

Activation bytes per token are measured, not guessed (measure()): a forward + backward of 1 and 2 decoder layers
and vision blocks at the model's real width (random init from the published config values in configs/memory.json,
no download), in bf16 as FSDP2 computes on CUDA (fp32 for device=cpu), on this CPU, with and without checkpointing;
TokenBytes counts the peak live bytes of the tensors with a token dimension (what a GPU allocator would hold for
them; weights and their gradients are counted above). Cached in configs/memory.json (--remeasure: again).
tests/test_memory_plan.py checks the sum against the peak resident set of the tiny model's train phase (peak_bytes).
"""
import ctypes
import dataclasses
import gc
import json
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
GIB = 2 ** 30
STORE = os.path.join(ROOT, "configs/memory.json")  # published config.json values of the hub models; measurements


def load_store(path: str = STORE) -> dict:
    with open(path) as f:
        return json.load(f)


def spec_of(model: str) -> dict:
    """The model's published values (configs/memory.json), or a local checkpoint's config.json in the same form."""
    published = load_store()["published"]
    if model in published:
        return published[model]
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    return dict(arch=c["model_type"], layers=c["text_config"]["num_hidden_layers"], depth=c["vision_config"]["depth"],
                text=c["text_config"], vision=c["vision_config"])


def build(spec: dict, layers: int, depth: int, vocab: int, dtype: torch.dtype):
    """The spec's Qwen*VLForConditionalGeneration with `layers` decoder layers and `depth` vision blocks, random init
    in `dtype` (no fp32 copy inflates the baseline), or on the meta device (dtype None: shapes only)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig
    from transformers import Qwen3VLForConditionalGeneration
    text = {k: v for k, v in spec["text"].items() if k != "layer_types"}  # derived from the depth
    text.update(num_hidden_layers=layers, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    qwen3 = spec["arch"] == "qwen3_vl"
    vision = dict(spec["vision"], depth=depth)
    if depth < spec["depth"]:  # truncated: one block of each kind
        vision.update({"deepstack_visual_indexes": [0]} if qwen3 else {"fullatt_block_indexes": [depth - 1]})
    config = (Qwen3VLConfig if qwen3 else Qwen2_5_VLConfig)(text_config=text, vision_config=vision,
                                                            tie_word_embeddings=text.get("tie_word_embeddings", False))
    config.text_config._attn_implementation = config.vision_config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.bfloat16)
    try:
        with torch.device("meta" if dtype is None else "cpu"):
            return (Qwen3VLForConditionalGeneration if qwen3 else Qwen2_5_VLForConditionalGeneration)(config).train()
    finally:
        torch.set_default_dtype(default)


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(key + ":")))


def peak_bytes(fn, *args) -> int:
    """How far fn(*args) raises the resident set at its peak above where it was (Linux VmHWM after clear_refs)."""
    ctypes.CDLL(None).mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: large frees return to the OS, never parked in a heap
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = status_kib("VmRSS")
    fn(*args)
    return (status_kib("VmHWM") - base) * 1024


class TokenBytes(TorchDispatchMode):
    """Live bytes, and their peak, of the tensors that ops create with a dimension in `sizes` (the tokens): activations
    and their gradients, not weights, weight gradients or scratch buffers, which do not grow with the tokens."""

    def __init__(self, sizes: set[int]):
        super().__init__()
        self.sizes, self.live, self.peak, self.seen = sizes, 0, 0, set()

    def free(self, key: int, nbytes: int):
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or not self.sizes & set(t.shape):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in self.seen:  # a view of a buffer already counted
                continue
            self.seen.add(storage.data_ptr())
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self.free, storage.data_ptr(), storage.nbytes())  # runs when it is freed
        return out


def decoder_step(model, tokens: int) -> int:
    hidden = model.config.text_config.hidden_size
    with TokenBytes({tokens}) as counter:
        x = torch.randn(1, tokens, hidden, dtype=model.dtype, requires_grad=True)  # the text + vision embeddings
        out = model.language_model(inputs_embeds=x).last_hidden_state
        out.backward(torch.ones_like(out))
    return counter.peak


def vision_step(model, patches: int) -> int:
    vc = model.config.vision_config
    with TokenBytes({patches, patches // 4}) as counter:  # patches, and the merged tokens
        pixels = torch.randn(patches, 3 * vc.temporal_patch_size * vc.patch_size ** 2, dtype=model.dtype)
        grid = torch.tensor([[patches // 144, 12, 12]])  # frames of 12 x 12 patches
        out = model.visual(pixels, grid_thw=grid).pooler_output  # merged features, what the decoder takes
        out.backward(torch.ones_like(out))
    return counter.peak


def logits_step(weight, positions: int) -> int:
    """train.token_logp's projection of `positions` response positions onto the vocabulary, as one chunk."""
    import train
    with TokenBytes({positions}) as counter:
        hidden = torch.randn(positions, weight.shape[1], dtype=weight.dtype, requires_grad=True)
        targets = torch.randint(len(weight), (positions,))
        logp, entropy = train.ChunkedLogp.apply(hidden, weight, targets, 1.0, [0], positions)
        (logp.sum() + entropy.sum()).backward()
    return counter.peak


def measure(spec: dict, dtype: torch.dtype) -> dict:
    """Peak bytes per token (decoder, logits) and per patch (vision) of a forward + backward, counted by TokenBytes:
    {"decoder": {"plain": {"layer": a, "rest": b}, "ckpt": {...}}, "vision": {...}, "logit_bytes": per logit}.
    L layers over T tokens peak at T * (L * a + b): one and two layers give a and b."""
    out = {}
    for part, step, n in (("decoder", decoder_step, 250), ("vision", vision_step, 3 * 144)):
        out[part] = {}
        for mode in ("plain", "ckpt"):
            per_token = {}
            for depth in (1, 2):
                model = build(spec, depth, depth, vocab=8, dtype=dtype).model
                if mode == "ckpt":
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                per_token[depth] = step(model, n) / n
            out[part][mode] = {"layer": per_token[2] - per_token[1], "rest": 2 * per_token[1] - per_token[2]}
            print(f"measured {part} {mode}: {out[part][mode]}", flush=True)
    weight = torch.randn(spec["text"]["vocab_size"], spec["text"]["hidden_size"], dtype=dtype, requires_grad=True)
    out["logit_bytes"] = logits_step(weight, 100) / 100 / len(weight)
    print(f"measured logits: {out['logit_bytes']} bytes per logit", flush=True)
    return out


def measured(model: str, dtype: torch.dtype, remeasure: bool = False, path: str = STORE) -> dict:
    """measure()'s result for the model and dtype, cached in configs/memory.json (measured and added if missing)."""
    store = load_store(path)
    key = f"{os.path.basename(os.path.normpath(model))} {str(dtype).removeprefix('torch.')}"
    if remeasure or key not in store["measured"]:
        store["measured"][key] = measure(spec_of(model), dtype)
        with open(path, "w") as f:
            json.dump(store, f, indent=1)
    return store["measured"][key]


def longest_prompt(cfg, height: int, width: int) -> tuple[int, int]:
    """(tokens, vision patches) of a multiple-choice question on a video of video_max_frames frames of a height x width
    source, resized as cache.py does and expanded by the model's processor as data.prepare does."""
    import cache
    import data
    import make_tiny_model
    from transformers import AutoProcessor
    spec = spec_of(cfg.model)
    local = cfg.model
    if not os.path.isdir(local):  # a hub name: the tiny checkpoint of its family has the same processor sizes
        local = make_tiny_model.ensure(spec["arch"], os.path.join(ROOT, ".cache/models"))
    processor = AutoProcessor.from_pretrained(local)
    factor, n = data.vision_factor(processor), cfg.video_max_frames // 2 * 2  # qwen-vl-utils: even frame counts
    budget = cache.frame_pixels(n, cfg.video_min_pixels, cfg.video_max_pixels, cfg.video_total_pixels, factor)
    h, w = cache.smart_resize(height, width, factor, cfg.video_min_pixels, budget)
    sample = dict(problem="<video>What does the person do after opening the door?", problem_type="multiple choice",
                  options=["A. sits down", "B. leaves", "C. waves", "D. reads"], videos=["v.mp4"])
    text = processor.apply_chat_template(data.chat_messages(sample, data.render_prompt(sample)), tokenize=False,
                                         add_generation_prompt=True)
    meta = dict(fps=cfg.video_fps, duration=n / cfg.video_fps, total_num_frames=n, frames_indices=list(range(n)))
    out = processor(text=[text], videos=[torch.zeros(n, 3, h, w, dtype=torch.uint8)], video_metadata=[meta],
                    do_resize=False, do_sample_frames=False, return_tensors="pt")
    return out["input_ids"].shape[1], int(out["video_grid_thw"].prod())


def param_counts(spec: dict) -> tuple[int, int, int]:
    """(all parameters, the largest decoder layer or vision block, the root's: what no layer or block holds)."""
    model = build(spec, spec["layers"], spec["depth"], vocab=spec["text"]["vocab_size"], dtype=None)
    blocks = list(model.model.language_model.layers) + list(model.model.visual.blocks)
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total = sum(p.numel() for p in model.parameters())
    return total, max(sizes), total - sum(sizes)


@dataclass
class Plan:
    """Bytes per GPU by holder; the peaks of the generation and train phases; rows of the largest micro-batch."""
    lines: dict
    generation: float
    train: float
    rows: int
    verdict: str


def plan(cfg, spec: dict, meas: dict, gpus: int, gpu_mem: float, cuda: bool, prompt: int, patches: int) -> Plan:
    """What each holder takes on one GPU for the train.Config `cfg`, with a prompt of `prompt` tokens (`patches`)."""
    total, block, root = param_counts(spec)
    compute, on_gpu, group = (2 if cuda else 4), 1 - cfg.offload, cfg.group_size  # bf16 copies on CUDA, else fp32
    row_len = prompt + cfg.max_response_len
    rows = max(1, cfg.max_tokens_per_micro_batch // row_len) if cfg.max_tokens_per_micro_batch else cfg.micro_batch_size
    encodes = rows // group if rows >= group else 1 + (group % rows > 0)  # split_batch keeps groups together
    encodes *= 1 - cfg.freeze_vision
    mode = "ckpt" if cfg.gradient_checkpointing else "plain"
    dec, vis = meas["decoder"][mode], meas["vision"][mode]
    merged = patches // spec["vision"].get("spatial_merge_size", 2) ** 2
    levels = 1 + len(spec["vision"].get("deepstack_visual_indexes", []))  # Qwen3-VL keeps deepstack features too
    kept = cfg.prompts_per_step // gpus if cfg.freeze_vision else encodes  # freeze_vision: every prompt of the step
    chunk = min(cfg.logp_chunk or rows * cfg.max_response_len, rows * cfg.max_response_len)
    lines = {
        "parameters (fp32 shards, + reference)": 4 * total / gpus * on_gpu * (1 + (cfg.kl_coef > 0)),
        "gradients (fp32 shards)": 4 * total / gpus * on_gpu,
        "optimizer (AdamW: 2 fp32 shards)": 8 * total / gpus * on_gpu,
        "gathered (root + 2 blocks, root grads)": (2 * root + 2 * block) * compute * (gpus > 1),
        f"vLLM ({cfg.gpu_memory_utilization} of the GPU)": cfg.gpu_memory_utilization * gpu_mem * cuda,
        f"activations ({rows} x {row_len} tokens, {mode})": rows * row_len * spec["layers"] * dec["layer"],
        f"vision activations ({encodes} x {patches} patches)": encodes * patches * spec["depth"] * vis["layer"],
        f"vision features ({kept} x {merged} tokens)": kept * merged * levels * spec["text"]["hidden_size"] * compute,
        # transients: one at a time (the logits in the lm_head's backward, then the layers', then the blocks')
        f"+ the largest: logits chunk ({chunk} x {spec['text']['vocab_size']})":
            chunk * spec["text"]["vocab_size"] * meas["logit_bytes"],
        "+ the largest: a decoder layer's backward": rows * row_len * dec["rest"],
        "+ the largest: a vision block's backward": encodes * patches * vis["rest"],
    }
    held = list(lines.values())
    generation = held[0] + held[2] + held[4]  # gradients are freed after each optimizer step
    train = sum(held[:-3]) + max(held[-3:]) - held[4] * (cfg.vllm_sleep and cuda)  # vLLM sleeps in the train phase
    usable = 0.9 * gpu_mem  # the rest: CUDA context, NCCL buffers, allocator fragmentation
    verdict = "FITS"
    if generation > usable:
        verdict = "DOES NOT FIT: gpu_memory_utilization (or offload: true)"
    elif train > usable and not cfg.gradient_checkpointing:
        verdict = "DOES NOT FIT: gradient_checkpointing: true"
    elif train > usable and rows > 1:
        verdict = f"DOES NOT FIT: max_tokens_per_micro_batch (now {rows} rows of {row_len} tokens)"
    elif train > usable and not cfg.freeze_vision:
        verdict = "DOES NOT FIT: freeze_vision: true"
    elif train > usable:
        verdict = f"DOES NOT FIT: video_max_frames / video_max_pixels (one row is {row_len} tokens)"
    return Plan(lines, generation, train, rows, verdict)


@dataclass
class Config:
    config: tuple[str, ...] = ("configs/qwen2_5_vl_7b.yaml",)
    """train.py YAML(s), each over the ones before it, as train.py --config"""
    gpus: int = 8
    """GPUs = FSDP2 ranks"""
    gpu_mem_gib: float = 80.0
    """memory per GPU"""
    frames: int = 0
    """video_max_frames instead of the config's (0 = the config's)"""
    tokens: int = 0
    """max_tokens_per_micro_batch instead of the config's (0 = the config's)"""
    video_hw: tuple[int, int] = (720, 1280)
    """height and width of the largest source video"""
    device: Literal["cuda", "cpu"] = "cuda"
    """cuda: bf16 compute and a colocated vLLM; cpu: train.py on this machine (fp32, vLLM's memory not counted)"""
    remeasure: bool = False
    """measure the model again (minutes) instead of reading configs/memory.json"""


def main(c: Config) -> Plan:
    import train
    cfg = train.load_config(["--config", *c.config])
    cfg = dataclasses.replace(cfg, video_max_frames=c.frames or cfg.video_max_frames,
                              max_tokens_per_micro_batch=c.tokens or cfg.max_tokens_per_micro_batch)
    cuda = c.device == "cuda"
    meas = measured(cfg.model, torch.bfloat16 if cuda else torch.float32, c.remeasure)
    prompt, patches = longest_prompt(cfg, *c.video_hw)
    p = plan(cfg, spec_of(cfg.model), meas, c.gpus, c.gpu_mem_gib * GIB, cuda, prompt, patches)
    print(f"{cfg.model} on {c.gpus} x {c.gpu_mem_gib:g} GiB: {cfg.video_max_frames} frames of {c.video_hw[0]}x"
          f"{c.video_hw[1]} -> {prompt} prompt tokens ({patches} patches) + {cfg.max_response_len} response tokens")
    for label, value in p.lines.items():
        print(f"  {label:<50} {value / GIB:7.2f} GiB")
    print(f"  generation phase {p.generation / GIB:.1f} GiB, train phase {p.train / GIB:.1f} GiB, "
          f"usable {0.9 * c.gpu_mem_gib:.0f} GiB (90%)")
    if prompt > cfg.max_prompt_len:
        print(f"note: {prompt}-token prompts exceed max_prompt_len {cfg.max_prompt_len} (data.prepare rejects them)")
    print(p.verdict)
    return p


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))

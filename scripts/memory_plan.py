"""Does a train.py config fit in GPU memory? Per-GPU bytes of the generation and train phases, before anything runs.

.venv/bin/python scripts/memory_plan.py --config configs/qwen2_5_vl_7b.yaml --gpus 8 --gpu-mem-gib 80
.venv/bin/python scripts/memory_plan.py --config configs/qwen2_5_vl_7b.yaml configs/qwen2_5_vl_7b_long.yaml --table
"""

import dataclasses
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
GIB = 2**30
SOURCE_HW = (
    720,
    1280,
)  # the largest source video: larger ones shrink to video_max_pixels, smaller give fewer tokens
STORE = os.path.join(
    ROOT, "configs/memory.json"
)  # published config.json values of the hub models; measurements


def stored(model: str, dtype: str) -> tuple[dict, dict]:
    """(config.json values, measurements in `dtype`) of a model in configs/memory.json (a local checkpoint: its
    config.json). Measured at the real width by tests/test_memory_plan.py::test_measurements_reproduce: bytes per token
    kept per decoder layer ("layer") and of one layer's backward ("rest"), the same per vision patch, per logit, and
    the parameters in all, in the largest layer or block, in the root."""
    with open(STORE) as f:
        store = json.load(f)
    key = f"{os.path.basename(os.path.normpath(model))} {dtype}"
    if key not in store["measured"]:
        raise KeyError(
            f"{STORE}: no measurements {key!r} (tests/test_memory_plan.py::test_measurements_reproduce)"
        )
    spec = store["published"].get(model)
    if spec is None:
        with open(os.path.join(model, "config.json")) as f:
            spec = json.load(f)
    # Omni: its thinker's (the trained model), under the model's type (its tiny checkpoint's)
    thinker = spec.get("thinker_config", spec)
    return thinker | {"model_type": spec["model_type"]}, store["measured"][key]


@dataclasses.dataclass
class Question:
    """The planner's question on a video, as the processor gets it: `frames` frames resized to height x width."""

    sample: dict
    text: str
    frames: int
    height: int
    width: int
    factor: int
    meta: dict


def question(cfg, processor, height: int, width: int) -> Question:
    """A question on video_max_frames frames of a height x width video, resized as cache.py does (scripts/gpu_check.py
    builds its prompt from it)."""
    import cache
    import data

    factor = cache.vision_factor(processor)
    n = cfg.video_max_frames // 2 * 2  # qwen-vl-utils: even frame counts
    budget = cache.frame_pixels(
        n, cfg.video_min_pixels, cfg.video_max_pixels, cfg.video_total_pixels, factor
    )
    h, w = cache.smart_resize(height, width, factor, cfg.video_min_pixels, budget)
    sample = dict(
        id="question",
        problem="<video>What happens in the video, and when?",
        problem_type="free-form",
        answer="",
        videos=["v.mp4"],
    )
    text = processor.apply_chat_template(
        data.chat_messages(sample, data.render_prompt(sample)),
        tokenize=False,
        add_generation_prompt=True,
    )
    meta = dict(
        fps=cfg.video_fps,
        duration=n / cfg.video_fps,
        total_num_frames=n,
        frames_indices=list(range(n)),
    )
    return Question(sample, text, n, h, w, factor, meta)


def longest_prompt(cfg, height: int, width: int) -> tuple[int, int]:
    """(tokens, vision patches) of a question on video_max_frames frames of a height x width video, resized as cache.py
    and expanded by the processor as data.prepare does, on frames of one merged token (factor^2 px: no memory)."""
    import make_tiny_model
    import torch
    from transformers import AutoProcessor

    from common import hf_config

    local = cfg.model
    if not os.path.isdir(
        local
    ):  # a hub name: the tiny checkpoint of its family has the same processor sizes
        local = make_tiny_model.ensure(stored(local, "bfloat16")[0]["model_type"])
    processor = AutoProcessor.from_pretrained(local)
    q = question(cfg, processor, height, width)
    factor = q.factor
    out = processor(
        text=[q.text],
        videos=[torch.zeros(q.frames, 3, factor, factor, dtype=torch.uint8)],
        video_metadata=[q.meta],
        do_resize=False,
        do_sample_frames=False,
        return_tensors="pt",
    )
    pairs = int(out["video_grid_thw"][0, 0])
    per_pair = q.height * q.width // factor**2  # frame pairs; merged tokens in each
    sound = 0
    if cfg.video_audio:
        # Omni: the soundtrack's tokens, one per position (Qwen2.5-Omni 25 a second, Qwen3-Omni 13)
        # up to the feature extractor's 30 s
        rate = getattr(hf_config(local), "position_id_per_seconds", 0)  # none: a deaf model
        sound = int(rate * min(30, q.meta["duration"]))
    return out["input_ids"].shape[1] + pairs * (per_pair - 1) + sound, int(
        out["video_grid_thw"].prod()
    ) * per_pair


@dataclasses.dataclass
class Plan:
    """Bytes per GPU: held in the train phase, its transients (the largest counts), vLLM's parts and need (its share
    holds them in the generation phase); the phases' peaks."""

    held: dict[str, float]
    transient: dict[str, float]
    vllm: dict[str, float]
    vllm_need: float
    generation: float
    train: float
    verdict: str
    host: dict[
        str, float
    ]  # host RAM per rank in a step (host_plan); the load's, alone, is "loading"
    host_rank: float  # the largest: a step's, a held-out round's (with offload), the load's
    fsdp: str  # the train.Config.fsdp planned: auto resolved as train.load_model resolves it


def lora_params(spec: dict, rank: int) -> int:
    """Adapter parameters of train.py's default lora_targets: rank x (inputs + outputs) of q, k, v, o, gate, up, down
    in every decoder layer."""
    text = spec["text_config"]
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    inner = text["intermediate_size"]
    q = heads * text.get("head_dim", hidden // heads)
    kv = text["num_key_value_heads"] * q // heads
    return (
        rank
        * text["num_hidden_layers"]
        * (2 * (hidden + q) + 2 * (hidden + kv) + 3 * (hidden + inner))
    )


def host_plan(
    cfg, spec: dict, meas: dict, gpus: int, patches: int, sp: int = 1
) -> dict[str, float]:
    """Host RAM per rank in a step: its TP group's prompts as uint8 frames (each decoded and processed once, by the
    rank whose part holds it, Layout.prepares; sp.share_prompts passes the group's engine the frames), fp32 pixels
    (the trainer's of the rank's own prompts; vLLM's processor's of every frame it is given, two copies at its peak,
    as `bench/long_video.py --plan-check` measures), the SP runs of its group's prompts (a TP peer builds its own from
    the frames), the offloaded states (pinned); between steps, a round of held-out prompts (train.held_out_accuracy:
    a training round's, each rank preparing its part, as above; the step's prompts freed); and, alone at the start,
    the fp32 model from_pretrained builds on the host."""
    from sp import FEATURE_CACHE_BYTES, Layout

    vision = spec["vision_config"]
    voxel = 3 * vision.get("temporal_patch_size", 2) * vision["patch_size"] ** 2  # values per patch
    frames = patches * voxel  # uint8 bytes of a prompt's frames
    # rank 0's TP group (ranks 0 to tp - 1) prepares the most prompts: Layout deals the remainder to the first ranks
    tp = cfg.rollout_tp
    layout = Layout(None, 0, sp, 0, max(1, gpus // sp), tp=tp, rank=0, world=gpus)
    mine = sum(len(layout.part(range(cfg.prompts_per_step), q)) for q in range(tp))
    own = len(layout.part(range(cfg.prompts_per_step), 0))  # rank 0's: the largest part
    # held_out_accuracy's round: each rank prepares its part of a training round, its engine takes its group's
    solo = dataclasses.replace(layout, tp=1)
    held_out = range(cfg.eval_max_samples * bool(cfg.val_data))
    each = -(-cfg.prompts_per_step // gpus)
    own_val = min(each, len(solo.part(held_out, 0)))
    val = sum(min(each, len(solo.part(held_out, q))) for q in range(tp))
    total = meas["params"]["total"]
    # the reference tower's features kept per sample (sp.FeatureCache, bf16 on GPU): up to its bound
    kept_reference = cfg.kl_coef > 0 and not cfg.freeze_vision
    sampled = mine * (cfg.loss_type != "sft")  # SFT: no engine gets the training prompts
    return {
        f"frames ({mine} prompts of its TP group x {frames / GIB:.2f} GiB, uint8)": mine * frames,
        f"pixels (fp32: the trainer's of its {own}, vLLM's of {sampled}, twice)": (
            own + 2 * sampled
        )
        * frames
        * 4,
        "SP runs (1/sp_size of its SP group's prompts' pixels)": cfg.prompts_per_step
        * frames
        * 4
        / gpus
        * (sp > 1),
        "offload (pinned fp32 weights, gradients, AdamW)": 16 * total / gpus * cfg.offload,
        f"held-out prompts ({val} a round, between steps; frames and pixels as above)": (
            9 * val + 4 * own_val
        )
        * frames,
        "reference features (sp.FeatureCache: every sample's, up to its bound)": FEATURE_CACHE_BYTES
        * kept_reference,
        "loading (the fp32 model on the host, alone, at the start)": 4 * total,
    }


def plan(
    cfg,
    spec: dict,
    meas: dict,
    gpus: int,
    gpu_mem: float,
    cuda: bool,
    prompt: int,
    patches: int,
    sp: int = 1,
    host_mem: float = 1024 * GIB,
    refused: tuple[str, ...] = (),
):
    """Bytes per GPU of train.py with `cfg`, sp_size `sp` (cuda: bf16, vLLM; else fp32 on CPU), `prompt`-token prompts:
    README "Memory"'s terms; sp > 1 (Ulysses): 1/sp of the tokens, frames and features, query heads padded to a
    multiple of sp (zero heads: their attention costs as much as a real head's). Host RAM per node (host_plan, gpus
    ranks up to 8 a node) against `host_mem`; `refused`: what vLLM's config checks refuse (rollout.engine_errors)."""
    total = meas["params"]["total"]
    block = meas["params"]["largest_layer"]
    root = meas["params"]["root"]
    text = spec["text_config"]
    vision = spec["vision_config"]
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    kv = text["num_key_value_heads"]
    head_dim = text.get("head_dim", hidden // heads)
    compute = 2 if cuda else 4  # bf16 copies on CUDA
    # LoRA: the base has no grads, no AdamW
    trained = lora_params(spec, cfg.lora_rank) if cfg.lora_rank else total
    from train import fsdp_choice

    memory = math.inf  # as train.load_model: CPU ranks replicate
    if cuda:
        memory = gpu_mem
    fsdp = fsdp_choice(cfg, total, memory, cuda, gpus)  # auto: what train.py will run
    holders = gpus  # fsdp replicate: whole parameters, gradients, AdamW states on every rank
    if fsdp == "replicate":
        holders = 1
    shard = 4 * total / holders * (1 - cfg.offload)
    row = prompt + cfg.max_response_len
    group = cfg.group_size
    states = 4 * trained / holders * (1 - cfg.offload)
    gathered = (2 * root + 2 * block) * compute  # fsdp reshard: the root + 2 units
    if fsdp == "keep":  # every unit kept gathered from its forward to its backward
        gathered = (root + total) * compute
    if fsdp == "replicate":  # no copies: sum_grads' one buffer of the summed gradients
        gathered = 4 * trained
    rows = (
        max(1, cfg.max_tokens_per_micro_batch // row)
        if cfg.max_tokens_per_micro_batch
        else cfg.micro_batch_size
    )
    encodes = (rows // group if rows >= group else 1 + (group % rows > 0)) * (
        1 - cfg.freeze_vision
    )  # whole groups
    # freeze_vision: the step's prompts
    kept = cfg.prompts_per_step * sp // gpus if cfg.freeze_vision else encodes
    merged = (
        patches
        / vision.get("spatial_merge_size", 2) ** 2
        * (1 + len(vision.get("deepstack_visual_indexes", [])))
    )
    tokens = rows * row / sp
    patches_here = patches / sp  # this rank's share of the tokens, frames and features
    padded = -(-heads // sp) * sp  # Ulysses gives each rank padded / sp heads
    # padded: a KV head per query head; else KV repeated to sp
    kv_sent = padded if heads % sp else math.lcm(kv, sp)
    # q, k, v, out of the zero heads, per token of this rank
    pad = 4 * (padded - heads) * head_dim * compute
    weights = shard * (
        1 + (cfg.kl_coef > 0 and not cfg.lora_rank)
    )  # LoRA's reference is the base, adapters off
    mode = "ckpt" if cfg.gradient_checkpointing else "plain"
    dec = meas["decoder"][mode]
    vis = meas["vision"][mode]
    chunk = min(cfg.logp_chunk or rows * cfg.max_response_len, rows * cfg.max_response_len)
    held = {
        "parameters (fp32 shards, + reference)": weights,
        f"gradients (fp32 shards of {trained / 1e6:,.0f}M)": states,
        f"optimizer (AdamW: 2 fp32 shards of {trained / 1e6:,.0f}M)": 2 * states,
        # gae: the critic's weights (LoRA: its own frozen base) and AdamW; its grads and activations live in its
        # update, when the policy's are freed, and are as large (one architecture, one micro-batch): no higher peak
        "critic (gae: parameters + AdamW shards)": (shard + 2 * states)
        * (cfg.adv_estimator == "gae"),
        # the bf16 copies FSDP2 computes with: on CUDA at any world size (the GPU check, LOG.md 2026-11-26)
        "gathered (root + 2 blocks, root grads; fsdp keep: all)": gathered * (gpus > 1 or cuda),
        f"decoder activations ({tokens:.0f} tokens, {mode})": tokens
        * text["num_hidden_layers"]
        * dec["layer"],
        f"padded heads' attention ({heads} -> {padded} heads)": tokens
        * text["num_hidden_layers"]
        * pad
        * (mode == "plain"),
        f"vision activations ({encodes} x {patches_here:.0f} patches)": encodes
        * patches_here
        * vision["depth"]
        * vis["layer"],
        f"vision features ({kept} x {merged / sp:.0f} tokens)": kept
        * merged
        / sp
        * hidden
        * compute,
    }
    # q, k, v, out sent and received
    a2a = 2 * (2 * padded + 2 * kv_sent) * head_dim * compute * (sp > 1)
    transient = {  # one at a time: the logits in the lm_head's backward, then the layers', then the blocks'
        f"logits chunk ({chunk} x {text['vocab_size']})": chunk
        * text["vocab_size"]
        * meas["logit_bytes"],
        "a decoder layer's backward (+ all-to-all, zero heads)": tokens * (dec["rest"] + a2a + pad),
        "a vision block's backward": encodes * patches_here * vis["rest"],
        f"freeze_vision's encode ({kept} x {patches_here:.0f} patches, one no-grad call; no activations yet)": kept
        * patches_here
        * meas["vision"]["encode"]
        * cfg.freeze_vision,
    }
    tp = cfg.rollout_tp
    # bf16 K, V per token, GPU
    kv_bytes = 2 * text["num_hidden_layers"] * max(kv // tp, 1) * head_dim * 2
    kv_tokens = max(
        cfg.max_model_len, prompt + group * cfg.max_response_len
    )  # the group shares its prompt's blocks
    # mm_encoder_tp_mode "data" (rollout.py, tp > 1): every rank
    tower = meas["params"]["vision"] * (tp - 1) / tp
    language = total
    # vllm_embeds: vLLM generates from the trainer's features and builds no tower (Qwen3-VL keeps
    # it for deepstack, never running it but in its start-up profile: rollout.VLLMEngine)
    no_tower = cfg.vllm_embeds and "deepstack_visual_indexes" not in vision
    if no_tower:
        tower = 0
        language = total - meas["params"]["vision"]
    vllm_parts = {  # holds the whole tower and encodes whole videos (one video is not split over the ranks)
        f"weights (bf16, / rollout_tp {tp}; the vision tower whole)": 2 * (language / tp + tower),
        f"KV cache ({kv_tokens} tokens)": kv_tokens * kv_bytes,
        f"encoding one video ({patches} patches, no grad)": patches
        * meas["vision"]["encode"]
        * (not no_tower),
    }
    # loss_type sft samples nothing: a vLLM engine only for held-out evaluation (else HF generate)
    engine = cfg.loss_type != "sft" or (cfg.rollout == "vllm" and bool(cfg.val_data))
    vllm = cfg.gpu_memory_utilization * gpu_mem * cuda * engine
    need = sum(vllm_parts.values()) * cuda * engine
    # vllm_embeds: the trainer's no-grad encode for vLLM (train.FrozenEncoder) runs with vLLM awake, on
    # a rank's own prompts (SP: its runs of its SP group's, as many patches)
    embeds_encode = patches * -(-cfg.prompts_per_step // gpus) * meas["vision"]["encode"]
    # weights, AdamW; gradients are freed after each step
    generation = weights + 2 * states + vllm + embeds_encode * cfg.vllm_embeds
    acts = sum(
        v for k, v in held.items() if "activations" in k or k.startswith("padded")
    )  # none at the encode
    # the features come before the passes: on the states, no activations
    *passes, encode = transient.values()
    train = max(sum(held.values()) + max(passes), sum(held.values()) - acts + encode) + vllm * (
        not cfg.vllm_sleep
    )
    over = train > 0.9 * gpu_mem  # 10% for the CUDA context, NCCL and fragmentation
    larger = [s for s in range(sp + 1, gpus + 1) if gpus % s == 0]
    host = host_plan(cfg, spec, meas, gpus, patches, sp)
    loading = host["loading (the fp32 model on the host, alone, at the start)"]
    offload = host["offload (pinned fp32 weights, gradients, AdamW)"]
    held_out = next(v for k, v in host.items() if k.startswith("held-out"))  # between steps
    step = sum(host.values()) - loading - held_out
    host_rank = max(step, held_out + offload, loading)
    node = host_rank * min(gpus, 8)
    knobs = (  # the first that applies, the knob to turn
        (refused, f"CANNOT RUN: {refused[0] if refused else ''}"),
        (gpus % sp, f"CANNOT RUN: sp_size {sp} must divide the {gpus} GPUs"),
        (gpus % tp, f"CANNOT RUN: rollout_tp {tp} must divide the {gpus} GPUs"),
        (sp > 1 and sp % tp, f"CANNOT RUN: sp_size {sp} % rollout_tp {tp} != 0"),
        (
            prompt > cfg.max_prompt_len,
            f"CANNOT RUN: max_prompt_len {cfg.max_prompt_len} < {prompt}-token prompts",
        ),
        (
            need > vllm,
            f"DOES NOT FIT: gpu_memory_utilization or rollout_tp (vLLM needs {need / GIB:.1f} GiB)",
        ),
        (generation > 0.9 * gpu_mem, "DOES NOT FIT: gpu_memory_utilization (or offload: true)"),
        (over and not cfg.gradient_checkpointing, "DOES NOT FIT: gradient_checkpointing: true"),
        (
            over and rows > 1,
            f"DOES NOT FIT: max_tokens_per_micro_batch (now {rows} rows of {row} tokens)",
        ),
        (over and larger, f"DOES NOT FIT: sp_size {' or '.join(map(str, larger))}"),
        (over and not cfg.freeze_vision, "DOES NOT FIT: freeze_vision: true"),
        (over, f"DOES NOT FIT: video_max_frames / video_max_pixels (one row is {row} tokens)"),
        (
            node > host_mem,
            f"DOES NOT FIT in host memory ({node / GIB:.0f} GiB per node of {host_mem / GIB:.0f}): "
            "eval_max_samples, prompts_per_step or rollout_tp",
        ),
    )
    verdict = next((knob for bad, knob in knobs if bad), "FITS")
    return Plan(
        held, transient, vllm_parts, need, generation, train, verdict, host, host_rank, fsdp
    )


@dataclasses.dataclass
class Config:
    config: tuple[str, ...] = ("configs/qwen2_5_vl_7b.yaml",)
    """train.py YAML(s), each over the ones before it, as train.py --config"""
    gpus: int = 0
    """GPUs = FSDP2 ranks (data-parallel x sp_size); 0: the N of the configs' launch line (a comment `torchrun
    --nproc_per_node=N train.py`)"""
    gpu_mem_gib: float = 80.0
    """memory per GPU"""
    host_memory_gib: float = 1024.0
    """host RAM per node of 8 GPUs (a typical 8 x 80 GB node has 1-2 TiB)"""
    frames: int = 0
    """video_max_frames instead of the config's (0 = the config's)"""
    tokens: int = 0
    """max_tokens_per_micro_batch instead of the config's (0 = the config's)"""
    table: bool = False
    """print the README's table instead: frames per video x sp_size 1/2/4/8, one video per micro-batch"""


def legal_tp(spec: dict, sp: int) -> int:
    """The largest rollout_tp that an SP group of `sp` ranks can hold and vLLM takes: it divides sp, the query heads,
    and the KV heads divide it or it divides them (rollout.engine_errors)."""
    text = spec["text_config"]
    heads = text["num_attention_heads"]
    kv = text["num_key_value_heads"]
    fits = [t for t in range(1, sp + 1) if sp % t == 0 and heads % t == 0]
    return max(t for t in fits if kv % t == 0 or t % kv == 0)


def table(c: Config, cfg, spec: dict, meas: dict) -> list[str]:
    """Markdown rows, frames x sp_size: verdict, train-phase GiB per GPU (the config's prompt and model lengths;
    rollout_tp the largest that vLLM takes in the SP group, legal_tp)."""
    lines = [
        "| frames | prompt tokens | sp_size 1 | sp_size 2 | sp_size 4 | sp_size 8 |",
        "|---|---|---|---|---|---|",
    ]
    for frames in (256, 512, 1024, 2048, 3600):
        one = dataclasses.replace(
            cfg, video_max_frames=frames, max_tokens_per_micro_batch=0, micro_batch_size=1
        )
        prompt, patches = longest_prompt(one, *SOURCE_HW)
        plans = [
            plan(
                dataclasses.replace(
                    one, rollout_tp=legal_tp(spec, sp) if sp > 1 else cfg.rollout_tp
                ),
                spec,
                meas,
                c.gpus,
                c.gpu_mem_gib * GIB,
                True,
                prompt,
                patches,
                sp,
                c.host_memory_gib * GIB,
            )
            for sp in (1, 2, 4, 8)
        ]
        cells = [f"{p.verdict.split(':')[0].lower()} ({p.train / GIB:.0f} GiB)" for p in plans]
        lines.append(f"| {frames} | {prompt:,} | {' | '.join(cells)} |")
    return lines


def launch_ranks(paths: tuple[str, ...], flag: str) -> int:
    """N of the last config (a layer names its own node) whose comment launches `torchrun --nproc_per_node=N train.py`;
    none does: an exit naming the command line's `flag` that gives N."""
    for path in reversed(paths):
        with open(path) as f:
            found = re.search(r"--nproc_per_node=(\d+) train\.py", f.read())
        if found:
            return int(found.group(1))
    sys.exit(
        f"{' '.join(paths)}: no `torchrun --nproc_per_node=N train.py` line in a header: give {flag} N"
    )


def layer_base(path: str) -> str:
    """The config a layer file names in its comment ("A layer over x.yaml": it sets only what differs, loaded after
    x.yaml), beside it; '' for a whole recipe."""
    with open(path) as f:
        found = re.search(r"layer over (\S+\.yaml)", f.read(), re.I)
    if not found:
        return ""
    return os.path.join(os.path.dirname(path), found.group(1))


def main(c: Config) -> Plan | list[str]:
    """Prints the config's plan (or the table) and returns it. A model measured only in float32 (the tiny CPU one)
    gets a CPU plan: fp32, per rank, vLLM not counted."""
    import rollout
    import train

    cfg = train.load_config(["--config", *c.config])  # checked as train.py checks it
    base = layer_base(c.config[0])
    if base:  # alone, the rest would be train.py's defaults (the tiny model)
        print(
            f"warning: {c.config[0]} is a layer: give its base first (--config {base} {c.config[0]})"
        )
    sp = cfg.sp_size
    gpus = c.gpus or launch_ranks(c.config, "--gpus")
    cfg = dataclasses.replace(
        cfg,
        video_max_frames=c.frames or cfg.video_max_frames,
        max_tokens_per_micro_batch=c.tokens or cfg.max_tokens_per_micro_batch,
    )
    cuda = True  # measured in bf16 (FSDP2 on CUDA), or only in fp32 (train.py on CPU)
    try:
        spec, meas = stored(cfg.model, "bfloat16")
    except KeyError:
        cuda = False
        spec, meas = stored(cfg.model, "float32")
    if c.table:
        lines = table(dataclasses.replace(c, gpus=gpus), cfg, spec, meas)
        print("\n".join(lines))
        return lines
    prompt, patches = longest_prompt(cfg, *SOURCE_HW)
    refused = ()
    # vLLM's own checks, without weights (an M-RoPE model's long context: long_overrides)
    if cfg.rollout == "vllm":
        refused = tuple(rollout.engine_errors(cfg.model, cfg.rollout_tp, cfg.max_model_len))
    host_mem = c.host_memory_gib * GIB
    args = (spec, meas, gpus, c.gpu_mem_gib * GIB, cuda, prompt, patches, sp, host_mem, refused)
    p = plan(cfg, *args)
    print(
        f"{cfg.model}, {gpus} {'GPUs' if cuda else 'CPU ranks (fp32)'}, sp_size {sp}, {cfg.video_max_frames} frames "
        f"(720p): {prompt} prompt tokens, {patches} patches"
    )
    parts = {
        "": p.held,
        "+ the largest: ": p.transient,
        "vLLM: ": p.vllm if cuda else {},
        "host: ": p.host,
    }
    for prefix, part in parts.items():
        for label, value in part.items():
            print(f"  {prefix + label:<62} {value / GIB:7.2f} GiB")
    ranks = min(gpus, 8)
    print(
        f"  host RAM {p.host_rank / GIB:.1f} GiB per rank, {p.host_rank * ranks / GIB:.0f} GiB per node "
        f"({ranks} ranks) of {c.host_memory_gib:.0f}"
    )
    for mode in ("reshard", "keep", "replicate"):  # what each train.Config.fsdp costs
        choice = plan(dataclasses.replace(cfg, fsdp=mode), *args)
        picked = ""
        if mode == p.fsdp:
            picked = " (auto)"
        print(f"  fsdp {mode:<9} train phase {choice.train / GIB:7.2f} GiB per rank{picked}")
    if not cuda and not p.verdict.startswith("CANNOT RUN"):
        print(
            f"CPU config: train phase {p.train / GIB:.2f} GiB per rank (vLLM's CPU KV cache and weights not counted)"
        )
    if cuda:
        print(
            f"  vLLM needs {p.vllm_need / GIB:.1f} GiB of its {cfg.gpu_memory_utilization * c.gpu_mem_gib:.0f}; "
            f"generation phase {p.generation / GIB:.1f} GiB, train phase {p.train / GIB:.1f} GiB, usable "
            f"{0.9 * c.gpu_mem_gib:.0f} GiB"
        )
    print(p.verdict)
    return p


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))

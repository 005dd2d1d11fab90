"""ckpt.py: sharded checkpoints (out_dir/ckpt/step_N: DCP shards, per-rank RNG, meta.json, config + processor;
`latest` names the newest complete one), exact resume; the full HF-named weights streamed out of FSDP2 shards
(hf_weights: the engine's weight sync and the final HF folder)."""

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from common import UserError, barrier, base_model, write_text

# the weight stream's extra memory: one bucket of gathered shards, plus one full tensor being reassembled (LoRA: and
# the base tensors of one adapted layer, waiting for its adapters)
SYNC_BUCKET_BYTES = 256 * 2**20


def model_optim_state(model, opt, critic=None) -> dict:
    """DCP's view of model + optimizer (+ the critic's, a train.Critic: gae): DTensor shards under FSDP2, so each
    rank writes and reads its own part."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # frozen parameters (a LoRA run's base model) are not saved: they are loaded from cfg.model and never change
    options = StateDictOptions(ignore_frozen_params=True)
    msd, osd = get_state_dict(model, opt, options=options)
    state = {"model": msd, "optim": osd}
    if critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(
            critic.model, critic.opt, options=options
        )
    return state


def save(
    out_dir: str,
    step: int,
    model,
    opt,
    processor,
    meta: dict,
    keep_last: int,
    rank: int,
    critic=None,
):
    """Every rank writes its shards and RNG state into step_N.tmp; after a barrier rank 0 adds meta.json, renames
    the folder to step_N, then points `latest` at it: a crash at any moment leaves `latest` complete."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = os.path.join(out_dir, "ckpt")
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        # left by a crash during an earlier attempt at this step
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    dcp.save(model_optim_state(model, opt, critic), checkpoint_id=tmp)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, os.path.join(tmp, f"rng_{rank}.safetensors"))
    barrier()  # every rank's files are written
    if rank == 0:
        write_text(os.path.join(tmp, "meta.json"), json.dumps(meta))
        # what export_hf.py and a new run read
        for part in (processor, model.config, model.generation_config):
            part.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a resumed run that reached this step again
        os.rename(tmp, final)
        write_text(os.path.join(root, "latest"), os.path.basename(final))
        # the folder `latest` names is never pruned (a run resumed from an older folder writes below newer steps)
        others = sorted(
            d
            for d in os.listdir(root)
            if d.startswith("step_") and not d.endswith(".tmp") and d != os.path.basename(final)
        )
        if keep_last:
            for old in others[: max(0, len(others) - keep_last + 1)]:  # keep_last - 1 of them stay
                shutil.rmtree(os.path.join(root, old))
    barrier()


def save_checkpoint(model, processor, path: str, rank: int, source: str):
    """Full HF-format folder (safetensors + config + processor) that vLLM and transformers load, in the published
    layout (published_layout; Omni: the thinker's weights under the whole config of `source`, the model trained);
    LoRA adapters are merged in (scripts/export_hf.py writes the adapter alone)."""
    from transformers import AutoConfig

    base = base_model(model)
    config = base.config
    if config.model_type.endswith("_thinker"):
        config = AutoConfig.from_pretrained(source)
    # a collective: every rank gathers, rank 0 keeps
    weights = published_layout(hf_weights(model), config.model_type)
    sd = {name: t.cpu() for name, t in weights if rank == 0}
    if rank == 0:
        base.save_pretrained(path, state_dict=sd)
        config.save_pretrained(path)
        processor.save_pretrained(path)
        model.generation_config.save_pretrained(path)


def published_layout(weights, model_type: str):
    """transformers 5.19 holds Qwen3-VL-MoE's fused experts as (experts, out, in), saves them so
    and loads either; the published checkpoints and vLLM's loader hold (experts, in, out). Omni:
    the trainer holds the thinker alone, the published names are under "thinker."."""
    prefix = ""
    if "omni" in model_type:
        prefix = "thinker."
    for name, w in weights:
        fused = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        yield prefix + name, w.transpose(1, 2) if fused and model_type == "qwen3_vl_moe" else w


def find(out_dir: str, resume: str) -> str:
    """The folder to resume from: '' (none), `resume` itself, or for 'auto' the one `latest` names ('' if none)."""
    latest = os.path.join(out_dir, "ckpt", "latest")
    if resume != "auto":
        return resume
    if not os.path.exists(latest):
        return ""
    with open(latest) as f:
        return os.path.join(out_dir, "ckpt", f.read().strip())


def load(path: str, model, opt, critic=None) -> dict:
    """Model, optimizer (+ critic's: gae) and this rank's RNG restored in place (DCP reshards: the world size may
    change; a new rank keeps its fresh RNG). Returns meta.json (step, data position, wandb id, ...)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if not os.path.exists(os.path.join(path, "meta.json")):
        raise UserError(f"{path}: not a complete checkpoint (no meta.json)")
    state = model_optim_state(model, opt, critic)
    dcp.load(state, checkpoint_id=path)
    # strict=False: the frozen base is not in `state`; dcp.load above already failed on any missing trainable tensor
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_state_dict(
        model,
        opt,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    if critic is not None:
        set_state_dict(
            critic.model,
            critic.opt,
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optim"],
            options=options,
        )
    rng = os.path.join(path, f"rng_{dist.get_rank() if dist.is_initialized() else 0}.safetensors")
    if os.path.exists(rng):
        rng = load_file(rng)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


# Full weights out of FSDP2 shards


def full_tensors(state: dict, bucket_bytes: int = SYNC_BUCKET_BYTES):
    """(name, full tensor) for every entry of a (FSDP2) state dict, in order. DTensors are gathered in buckets of one
    dtype and about bucket_bytes, one collective per bucket: every rank must consume the whole iterator."""
    bucket = []
    size = 0  # its bytes
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if bucket and (
            not isinstance(t, DTensor)
            or t.dtype != bucket[0][1].dtype
            or size + nbytes > bucket_bytes
        ):
            yield from gather_bucket(bucket)
            bucket = []
            size = 0
        if isinstance(t, DTensor):
            bucket.append((name, t))
            size += nbytes
        else:
            yield name, t
    yield from gather_bucket(bucket)


def gather_bucket(bucket: list):
    """One all-gather for Shard(0) DTensors. FSDP2 splits dim 0 like torch.chunk: ceil(N / world) rows per rank, the
    last ranks' shorter or empty; each rank packs its shards, zero-padded to that size, into one flat buffer."""
    if not bucket:
        return
    first = bucket[0][1]
    if any(t.placements != (Shard(0),) for _, t in bucket):
        raise ValueError(
            f"weight sync: only 1-D FSDP2 meshes (Shard(0)) are supported, got {first.placements}"
        )
    world = first.device_mesh.size()
    rows = [-(-t.shape[0] // world) for _, t in bucket]
    sizes = [r * t.shape[1:].numel() for r, (_, t) in zip(rows, bucket)]
    flat = torch.cat(
        [
            F.pad(t.to_local().flatten(), (0, k - t.to_local().numel()))
            for (_, t), k in zip(bucket, sizes)
        ]
    )
    out = flat.new_empty(world * flat.numel())
    # all_gather_single: torch 2.14's name for all_gather_into_tensor (older torch on GPU machines: the old name);
    # gloo takes the flat (not stacked) output
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    all_gather(out, flat, group=first.device_mesh.get_group())
    for (name, t), r, part in zip(bucket, rows, out.view(world, -1).split(sizes, dim=1)):
        # row j of part is rank j's shard of t: in rank order they are t and its padding rows
        yield name, part.reshape(world * r, *t.shape[1:])[: t.shape[0]]


def hf_weights(model):
    """(HF name, full tensor) of each of the model's weights in state-dict order, on full_tensors' bucketed stream (a
    collective: every rank consumes all of it). A peft LoRA model yields its base model's names with the adapters
    merged, W + scaling * B A: peft's order per adapted layer X is `X.base_layer.weight` (and `.bias`), `X.lora_A...`,
    `X.lora_B...`, so the base tensors wait for their lora_B, then go out as `X.weight` (merged) and `X.bias`."""
    lora = {name: m for name, m in model.named_modules() if hasattr(m, "lora_A")}
    held = []  # the adapted layer's base tensors, until its B arrives
    lora_a = None  # and its A
    for name, t in full_tensors(model.state_dict()):
        layer = name.partition(".lora_")[0]
        adapter = name.partition(".lora_")[2]
        if adapter.startswith("A."):
            lora_a = t
        elif adapter.startswith("B."):
            # never merged into another layer, never dropped
            if not held or held[0][0] != f"{layer}.base_layer.weight":
                raise ValueError(
                    f"weight sync: {name} does not follow its base weight (peft's state-dict order?)"
                )
            weight_name, w = held[0]
            delta = t.to(w.dtype) @ lora_a.to(w.dtype)
            held[0] = (weight_name, w + lora[layer].scaling["default"] * delta)
            for held_name, tensor in held:
                yield base_name(held_name), tensor
            held = []
        elif held or name.endswith(".base_layer.weight"):
            held.append((name, t))
        else:
            yield base_name(name), t
    if held:
        raise ValueError(f"weight sync: no lora_B followed {held[0][0]} (peft's state-dict order?)")


def base_name(name: str) -> str:
    """The base model's name of a (peft-wrapped) state-dict entry."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")

"""ckpt.py: sharded checkpoints (out_dir/ckpt/step_N: DCP shards, per-rank RNG, meta.json, config + processor;
`latest` names the newest complete one), exact resume, preemption; the process group and the collectives."""
import datetime
import json
import os
import shutil
import signal

import torch
import torch.distributed as dist

from rollout import hf_weights


# Collectives: every rank calls them at the same point of the loop

def all_reduce(x: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """A few numbers reduced over all ranks, in float64, on the device the backend needs (nccl: GPU, gloo: CPU)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor(x, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return t.tolist()


def gather(obj) -> list:
    """All ranks' objects, in rank order (small metric dicts only)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any: a signal may reach only some ranks."""
    return bool(all_reduce([float(flag)], dist.ReduceOp.MAX)[0])


def barrier():
    if dist.is_initialized():
        dist.barrier()


def init_dist(timeout_s: float = 1800.0, offload: bool = False):
    """torchrun or plain python: (rank, world, device). gloo on CPU, nccl on GPU (offload: + gloo, CPU shards)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    if not dist.is_initialized():  # main() may run again in the same process (tests)
        gpu_backend = "cuda:nccl,cpu:gloo" if offload else "nccl"
        dist.init_process_group(gpu_backend if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")


def print0(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


# Checkpoints

def catch_stop_signals(catch: bool = True) -> list:
    """catch (the step loop): the first SIGTERM/SIGINT (preemption, Ctrl-C) is only recorded in the list returned, the
    loop checkpoints at the next step boundary and exits 0. A second one, or any with catch=False (startup, the end of
    a run: no step to finish), ends the process at once, even inside C code: a run that hangs can always be stopped."""
    got = []

    def record(num, frame):
        got.append(num)
        catch_stop_signals(catch=False)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, record if catch else signal.SIG_DFL)
    return got


def model_optim_state(model, opt) -> dict:
    """DCP's view of model + optimizer: DTensor shards under FSDP2, so each rank writes and reads its own part."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    # frozen parameters (a LoRA run's base model) are not saved: they are loaded from cfg.model and never change
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": msd, "optim": osd}


def save(out_dir: str, step: int, model, opt, processor, meta: dict, keep_last: int, rank: int):
    """Every rank writes its shards and RNG state into step_N.tmp; after a barrier rank 0 adds meta.json, renames
    the folder to step_N, then points `latest` at it: a crash at any moment leaves `latest` complete."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    root = os.path.join(out_dir, "ckpt")
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier attempt at this step
    barrier()
    dcp.save(model_optim_state(model, opt), checkpoint_id=tmp)
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    save_file(rng, os.path.join(tmp, f"rng_{rank}.safetensors"))
    barrier()  # every rank's files are written
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        for part in (processor, model.config, model.generation_config):  # what export_hf.py and a new run read
            part.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a resumed run that reached this step again
        os.rename(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        # the folder `latest` names is never pruned (a run resumed from an older folder writes below newer steps)
        others = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")
                        and d != os.path.basename(final))
        if keep_last:
            for old in others[:max(0, len(others) - keep_last + 1)]:  # keep_last - 1 of them stay
                shutil.rmtree(os.path.join(root, old))
    barrier()


def save_checkpoint(model, processor, path: str, rank: int):
    """Full HF-format folder (safetensors + config + processor) that vLLM and transformers load; LoRA adapters are
    merged in (scripts/export_hf.py writes the adapter alone)."""
    sd = {name: t.cpu() for name, t in hf_weights(model) if rank == 0}  # a collective: every rank gathers, rank 0 keeps
    if rank == 0:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.save_pretrained(path, state_dict=sd)
        processor.save_pretrained(path)
        model.generation_config.save_pretrained(path)


def find(out_dir: str, resume: str) -> str:
    """The folder to resume from: '' (none), `resume` itself, or for 'auto' the one `latest` names ('' if none)."""
    latest = os.path.join(out_dir, "ckpt", "latest")
    if resume != "auto":
        return resume
    return os.path.join(out_dir, "ckpt", open(latest).read().strip()) if os.path.exists(latest) else ""


def load(path: str, model, opt) -> dict:
    """Model, optimizer and this rank's RNG restored in place (DCP reshards: the world size may change; a new rank
    keeps its fresh RNG). Returns meta.json (step, data position, wandb id, ...)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    if not os.path.exists(os.path.join(path, "meta.json")):
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no meta.json)")
    state = model_optim_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    # strict=False: the frozen base is not in `state`; dcp.load above already failed on any missing trainable tensor
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    rng = os.path.join(path, f"rng_{dist.get_rank() if dist.is_initialized() else 0}.safetensors")
    if os.path.exists(rng):
        rng = load_file(rng)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)

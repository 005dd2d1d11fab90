"""A training checkpoint (DCP folder of any world size, or the `latest` pointer) -> a Hugging Face folder (safetensors
+ config + processor) for transformers and vllm.LLM; a LoRA run's -> the adapter in PEFT's format (base: the run's
`model`), or with --merge the base model with the adapters merged.

    python scripts/export_hf.py runs/tiny_cpu/ckpt/step_00000060 runs/tiny_cpu/hf_step60   # or ckpt/latest
    python scripts/export_hf.py runs/X/ckpt/latest runs/X/hf --dtype bfloat16 [--merge]     # half the size, for serving
"""

import json
import os
from typing import Literal

import torch
import tyro
from tyro.conf import Positional

import repo  # noqa: F401  (puts the project root on sys.path)


def export(
    ckpt: Positional[str],
    out: Positional[str],
    dtype: Literal["float32", "bfloat16"] = "float32",
    merge: bool = False,
):
    """Only the model's tensors, config and processor are read.

    Args:
        ckpt: a checkpoint folder (runs/X/ckpt/step_N) or the `latest` file that names one
        out: the folder to write
        dtype: the saved weights' (the checkpoint's are fp32)
        merge: a LoRA run's adapters merged into the base (W + scale * B A), not the adapter alone (PEFT's format)
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import (
        AutoConfig,
        AutoModelForImageTextToText,
        AutoProcessor,
        GenerationConfig,
    )

    from ckpt import save_checkpoint
    import train

    if os.path.isfile(ckpt):  # the `latest` pointer file
        ckpt = os.path.join(os.path.dirname(ckpt), open(ckpt).read().strip())
    with open(os.path.join(ckpt, "meta.json")) as f:
        cfg = train.Config(**json.load(f)["config"])
    if cfg.lora_rank:  # the frozen base from cfg.model, its adapters from the checkpoint
        model = train.load_model(cfg, torch.device("cpu"))
    else:
        model = AutoModelForImageTextToText.from_config(
            AutoConfig.from_pretrained(ckpt), dtype=torch.float32
        )
    # the tensors ckpt.save wrote (trainable ones), in place; strict: a missing tensor raises
    state = {
        "model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    }
    dcp.load(state, checkpoint_id=ckpt)
    model.generation_config = GenerationConfig.from_pretrained(ckpt)
    model.to(getattr(torch, dtype))
    processor = AutoProcessor.from_pretrained(ckpt)
    if cfg.lora_rank and not merge:
        # the base as the adapter names it: a local folder absolute (loads from any working folder), a hub id as is
        if os.path.isdir(cfg.model):
            model.peft_config["default"].base_model_name_or_path = os.path.abspath(cfg.model)
        model.save_pretrained(out)  # adapter_config.json + adapter_model.safetensors (peft)
        processor.save_pretrained(out)
    else:
        save_checkpoint(model, processor, out, 0, cfg.model)
    return out


if __name__ == "__main__":
    out = tyro.cli(export)
    print(f"wrote {out}: {', '.join(sorted(os.listdir(out)))}")

"""Convert a training checkpoint (torch.distributed.checkpoint folder) into a Hugging Face folder
(safetensors + config + processor) that transformers and vllm.LLM load. One process, any world size it was
saved with: DCP gathers the shards into full tensors.

    python scripts/export_hf.py runs/tiny_cpu/ckpt/step_00000060 runs/tiny_cpu/hf_step60
    python scripts/export_hf.py runs/tiny_cpu/ckpt/latest runs/tiny_cpu/hf_latest   # the `latest` pointer works too
    python scripts/export_hf.py runs/X/ckpt/latest runs/X/hf --dtype bfloat16        # half the size, for serving
"""
import os
import sys
from typing import Literal

import torch
import tyro
from tyro.conf import Positional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export(ckpt: Positional[str], out: Positional[str], dtype: Literal["float32", "bfloat16"] = "float32"):
    """Reads only the model's tensors (not the optimizer); config and processor come from the checkpoint itself.
    dtype: the saved weights' (the checkpoint holds fp32 master weights)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, GenerationConfig

    import train
    if os.path.isfile(ckpt):  # the `latest` pointer file
        ckpt = os.path.join(os.path.dirname(ckpt), open(ckpt).read().strip())
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)  # in place, strict: a missing tensor raises
    model.generation_config = GenerationConfig.from_pretrained(ckpt)
    model.to(getattr(torch, dtype))
    train.save_checkpoint(model, AutoProcessor.from_pretrained(ckpt), out, rank=0)
    return out


if __name__ == "__main__":
    print(tyro.cli(export))

"""sp.py: sequence parallelism for long videos (Ulysses). The world is dp x sp: an SP group of sp_size consecutive
ranks trains the same rows, each rank holding 1/sp_size of every sequence's positions.

    vision     each rank encodes 1/sp_size of the temporal patches (the Qwen-VL towers attend within one: exact)
    embed      the model builds the full embeddings and M-RoPE positions; a pre-hook keeps this rank's (sequence_shard)
    attention  "ulysses_<kernel>": all-to-all from position to head shards, the model's kernel, all-to-all back
    log-probs  each rank projects the response positions it holds; summed over the group, each rank's loss is whole
"""
import contextlib
import functools
import itertools
import math
import types
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single

from common import base_model

MEDIA = (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw"))


@dataclass
class Layout:
    """This rank's place in the dp x sp world and in its rollout engine's TP group: all the rank arithmetic. SP and
    TP groups are sp_size and tp consecutive ranks; rank r trains on the rows r::world of a step's prompts."""
    group: object    # the SP group's process group (None with sp_size 1)
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int
    tp: int = 1      # the rollout engine's tensor-parallel size
    rank: int = 0    # dp_rank * sp_size + sp_rank
    world: int = 1   # dp_size * sp_size

    def share(self, items: list, size: int, rank: int | None = None) -> tuple[list, int, int]:
        """The list the group of `size` consecutive ranks around `rank` (default: this one) works on, the same on its
        ranks (size tp: what its engine generates), and where the rank's own part lies in it: (list, start, length)."""
        rank = self.rank if rank is None else rank
        first = rank - rank % size
        parts = [items[q::self.world] for q in range(first, first + size)]
        return [x for part in parts for x in part], sum(map(len, parts[:rank - first])), len(parts[rank - first])

    def prepares(self, i: int) -> bool:
        """Whether this rank prepares item i of a step's prompts: the TP or SP group that uses it does."""
        size = max(self.tp, self.sp_size)
        return i % self.world // size == self.rank // size

    def dedup(self, parts: list) -> list:
        """Per-rank objects gathered in rank order -> one per SP group (its ranks hold the same rows)."""
        return parts[::self.sp_size]


def make_layout(sp_size: int, tp: int = 1) -> Layout:
    """Creates the SP process groups: new_group is collective, so every rank creates every group."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    groups = [None] * (world // sp_size)
    if sp_size > 1:
        groups = [dist.new_group(list(range(start, start + sp_size))) for start in range(0, world, sp_size)]
    dp_rank, dp_size = rank // sp_size, world // sp_size
    return Layout(groups[dp_rank], rank % sp_size, sp_size, dp_rank, dp_size, tp, rank, world)


class AllReduce(torch.autograd.Function):
    """The sum over the SP group of tensors zero outside each rank's part. Backward: the gradient summed over the group
    (sum_grads: each rank used the sum in another place) or as it is (each computed the same loss from the sum)."""

    @staticmethod
    def forward(ctx, x, group, sum_grads: bool):
        ctx.group, ctx.sum_grads = group, sum_grads
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grads:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def encode_vision(model, prompts: list, device, layout: Layout | None = None) -> tuple[dict, int]:
    """The vision tower, once per modality, over the distinct prompts' media (a group's rows share one Prompt): {kind:
    (the encoder output, per-item tuples; {id(prompt): its item indices})}, and how many pieces this rank encoded.
    SP: each rank encodes one of sp_size contiguous runs of the temporal patches, the features are summed over the
    group; an empty run encodes the first patch with weight 0 (FSDP2: every rank runs the tower as often)."""
    distinct = list({id(p): p for p in prompts}.values())
    merge2 = model.config.vision_config.spatial_merge_size ** 2
    r, n = (layout.sp_rank, layout.sp_size) if layout else (0, 1)
    out, count = {}, 0
    for kind, pixels, grid in MEDIA:
        mine = [p for p in distinct if pixels in p.mm]
        if not mine:
            continue
        grids = torch.cat([p.mm[grid] for p in mine])                                  # (items, 3): t, h, w
        units = [i for i, t in enumerate(grids[:, 0].tolist()) for _ in range(t)]  # each temporal patch's item
        row = list(itertools.accumulate([int(grids[i, 1:].prod()) for i in units], initial=0))  # its first pixel row
        a, b = len(units) * r // n, len(units) * (r + 1) // n
        lo, hi = (a, b) if b > a else (0, 1)  # an empty run encodes the first patch (weight 0 below)
        pieces = [(i, len(list(g))) for i, g in itertools.groupby(units[lo:hi])]      # (item, its patches here)
        grid_thw = torch.tensor([[t, *grids[i, 1:].tolist()] for i, t in pieces])
        # the run's pixel rows [row[lo], row[hi]) of the prompts' rows one after another, sliced from each prompt's
        # tensor (the media are never all copied)
        firsts = itertools.accumulate([len(p.mm[pixels]) for p in mine], initial=0)
        rows = [p.mm[pixels][max(row[lo] - s, 0):max(row[hi] - s, 0)] for p, s in zip(mine, firsts)]
        enc = getattr(model, f"get_{kind}_features")(torch.cat(rows).to(device), grid_thw.to(device),
                                                     return_dict=True)  # the model's own (Qwen3-VL: + deepstack)
        count += len(pieces)
        tok = [x // merge2 for x in row]  # the first feature of each patch
        full = []
        for level in [enc.pooler_output] + list(getattr(enc, "deepstack_features", None) or []):
            local = torch.cat(level)
            if n > 1:  # this rank's features in place, zeros elsewhere, summed over the group
                part = F.pad(local[:tok[b] - tok[a]], (0, 0, tok[a], tok[-1] - tok[b]))
                local = AllReduce.apply(part, layout.group, True) + 0.0 * local.sum()
            full.append(torch.split(local, (grids.prod(-1) // merge2).tolist()))
        fields = {"pooler_output": full[0]}
        if len(full) > 1:
            fields["deepstack_features"] = full[1:]
        starts = itertools.accumulate([len(p.mm[grid]) for p in mine], initial=0)
        out[kind] = (replace(enc, **fields), {id(p): range(s, s + len(p.mm[grid])) for p, s in zip(mine, starts)})
    return out, count


def group_rollouts(rollouts: list, baselines: list[float], prompts: list, n: int, layout: Layout) -> tuple[list, list]:
    """The SP group's rollouts and baselines, the same on its ranks: the ranks' parts (tokens, log-probs, text, finish;
    not the media) gathered in rank order onto this rank's Prompts (the group's, Layout.share's order), n each."""
    parts = [None] * layout.sp_size
    dist.all_gather_object(parts, ([replace(r, prompt=None) for r in rollouts], baselines), group=layout.group)
    done = [x for part, _ in parts for x in part]
    return [replace(x, prompt=prompts[i // n]) for i, x in enumerate(done)], [b for _, part in parts for b in part]


def language_model(model):
    return base_model(model).model.language_model


def use_ulysses(model):
    """Registers "ulysses_<kernel>" (attention and its mask function) and sets it on the language model: outside an
    SP forward it is the kernel itself, so generation and single-sequence forwards are unchanged."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    config = language_model(model).config
    kernel = config._attn_implementation.removeprefix("ulysses_")
    AttentionInterface.register(f"ulysses_{kernel}", functools.partial(ulysses_attention, kernel=kernel))
    AttentionMaskInterface.register(f"ulysses_{kernel}", ALL_MASK_ATTENTION_FUNCTIONS[kernel])
    config._attn_implementation = f"ulysses_{kernel}"


def ulysses_attention(module, query, key, value, attention_mask, kernel: str, sp_shard=None, **kw):
    """q (B, H, S/n, d), k/v (B, Hkv, S/n, d) -> (B, S/n, H, d), the layout attention functions return. KV heads are
    repeated up to a multiple of n (GQA with Hkv < n, as verl), each rank attends with H/n heads over all S.
    sp_shard (a Shard, through the model's **kwargs): None outside an SP forward, then it is the kernel itself."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    inner = ALL_ATTENTION_FUNCTIONS[kernel]
    if sp_shard is None:
        return inner(module, query, key, value, attention_mask, **kw)
    group, n = sp_shard.layout.group, sp_shard.layout.sp_size
    H, s = query.shape[1], query.shape[2]
    rep = n // math.gcd(key.shape[1], n)
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    # (B, h, s, d) -> (n, B, h/n, s, d): head chunk j to rank j; back as rank j's positions -> (B, h/n, S, d).
    # all_to_all_single: chunk j of dim 0 to rank j, differentiable (its adjoint is itself)
    q, k, v = (all_to_all_single(x.unflatten(1, (n, -1)).transpose(0, 1).contiguous(), None, None, group)
               .permute(1, 2, 0, 3, 4).flatten(2, 3) for x in (query, key, value))
    # what the kernel reads of the module, for this rank's heads (sdpa repeats KV heads by num_key_value_groups)
    heads = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=kernel), is_causal=True,
                                  layer_idx=module.layer_idx, num_key_value_groups=H // key.shape[1],
                                  training=module.training)
    out, _ = inner(heads, q, k, v, sp_shard.mask, **kw)                                     # (B, S, H/n, d)
    # (B, S, H/n, d) -> (n, B, s, H/n, d): positions of rank j to rank j; back as rank j's heads -> (B, s, H, d)
    back = all_to_all_single(out.unflatten(1, (n, s)).transpose(0, 1).contiguous(), None, None, group)
    return back.permute(1, 2, 0, 3, 4).flatten(2, 3), None


def kernel_mask(mask: torch.Tensor, kernel: str) -> torch.Tensor:
    """The padding mask (B, S) as the kernel takes it: sdpa a causal (B, 1, S, S) bool mask where padding queries see
    themselves (a row with no key is NaN, and NaN * 0 gradient is NaN); flash-attn the 2-D mask (it unpads)."""
    if kernel != "sdpa":
        return mask
    pos = torch.arange(mask.shape[1], device=mask.device)                    # key <= query, key a token or the query
    return ((pos[None, :] <= pos[:, None]) & (mask.bool()[:, None, :] | (pos[None, :] == pos[:, None])))[:, None]


def shard_inputs(module, args, kwargs, shard):
    """Forward pre-hook of the language model: the full sequence's embeddings and positions (and Qwen3-VL's deepstack
    inputs) -> this rank's positions of the sequence padded to a multiple of sp_size."""
    emb = kwargs["inputs_embeds"]                                                            # (B, S, D)
    pad, keep = (shard.stop - shard.start) * shard.layout.sp_size - emb.shape[1], slice(shard.start, shard.stop)
    pos = kwargs["position_ids"]  # (3, B, S) M-RoPE; never None here: multi-rank micro-batches hold both media
    kwargs.update(inputs_embeds=F.pad(emb, (0, 0, 0, pad))[:, keep], position_ids=F.pad(pos, (0, pad))[..., keep],
                  attention_mask=None, sp_shard=shard)
    visual = kwargs.get("visual_pos_masks")                                                  # (B, S) bool
    if visual is not None:
        visual = F.pad(visual, (0, pad))
        mine = torch.zeros_like(visual)
        mine[:, keep] = True
        kwargs["visual_pos_masks"] = visual[:, keep]
        kwargs["deepstack_visual_embeds"] = [e[mine[visual]] for e in kwargs["deepstack_visual_embeds"]]
    return args, kwargs


@dataclass
class Shard:
    """This rank's positions [start, stop) of a sequence of `length` tokens (sp_size 1: all of them), and the kernel's
    mask for the whole sequence padded to a multiple of sp_size (sdpa (B, 1, S, S) bool, flash-attn (B, S)); None
    without padding: the kernel's causal mode, no O(S^2) mask (no token sees the tail padding)."""
    layout: Layout | None
    length: int
    start: int
    stop: int
    mask: torch.Tensor | None = None

    def response_span(self, R: int) -> tuple[int, int]:
        """The response tokens [a, b) of the last R predicted in this shard (token j at position length - R - 1 + j)"""
        first = self.length - R - 1
        a = min(max(self.start, first), self.length - 1) - first
        return a, max(min(self.stop, self.length - 1) - first, a)

    def gather(self, x: torch.Tensor, R: int) -> torch.Tensor:
        """(b, r) of this rank's response span -> (b, R), the SP group's spans together."""
        if self.layout is None or self.layout.sp_size == 1:
            return x
        a, b = self.response_span(R)
        return AllReduce.apply(F.pad(x, (a, R - b)), self.layout.group, False)


@contextlib.contextmanager
def sequence_shard(model, attention_mask: torch.Tensor, layout: Layout | None):
    """In it, `model`'s language model runs on this rank's shard of the sequence, attending over all of it."""
    S = attention_mask.shape[1]
    if layout is None or layout.sp_size == 1:
        yield Shard(layout, S, 0, S)
        return
    size = -(-S // layout.sp_size)
    lm = language_model(model)
    mask = None
    if not attention_mask.all():
        mask = kernel_mask(F.pad(attention_mask, (0, size * layout.sp_size - S)),
                           lm.config._attn_implementation.removeprefix("ulysses_"))
    shard = Shard(layout, S, layout.sp_rank * size, (layout.sp_rank + 1) * size, mask)
    handle = lm.register_forward_pre_hook(functools.partial(shard_inputs, shard=shard), with_kwargs=True)
    try:
        yield shard
    finally:
        handle.remove()

"""sp.py: sequence parallelism for long videos (Ulysses). The world is dp x sp: an SP group of sp_size consecutive
ranks trains the same rows, each rank holding 1/sp_size of every sequence's positions.

    vision     each SP rank encodes 1/sp_size of the media's temporal patches (the Qwen-VL towers attend within one
               temporal patch, so a split grid encodes exactly), the features are all-gathered (encode_vision)
    embed      the model's own forward builds the full inputs_embeds and M-RoPE positions; a pre-hook on the language
               model pads them to a multiple of sp_size and keeps this rank's positions (sequence_shard)
    attention  all-to-all from position shards to head shards, the model's kernel (sdpa / flash-attn) over the full
               sequence, all-to-all back: registered as "ulysses_<kernel>" in transformers' AttentionInterface
    log-probs  each rank projects the response positions it holds; the (b, R) pieces are all-gathered, and every SP
               rank computes the same loss from them (the gather's backward keeps the rank's own slice: no sum)
"""
import contextlib
import functools
import itertools
import math
import operator
import types
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rollout import encode_vision as encode_vision_whole

MEDIA = (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw"))


@dataclass
class Layout:
    """This rank's place in the dp x sp world; SP groups are sp_size consecutive ranks."""
    group: object    # the SP group's process group (None with sp_size 1)
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int


def make_layout(sp_size: int) -> Layout:
    """Creates the SP process groups: new_group is collective, so every rank creates every group."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    group = None
    for start in range(0, world, sp_size):
        ranks = list(range(start, start + sp_size))
        made = dist.new_group(ranks) if sp_size > 1 else None
        if rank in ranks:
            group = made
    return Layout(group, rank % sp_size, sp_size, rank // sp_size, world // sp_size)


class Gather(torch.autograd.Function):
    """The SP ranks' pieces (sizes[j] along dim on rank j) concatenated in rank order. Backward: this rank's slice of
    the gradient, summed over the SP ranks (sum_grads: each used the gathered value in a different part of the
    sequence) or as is (every rank computed the same loss from the same gathered values)."""

    @staticmethod
    def forward(ctx, x, layout: Layout, sizes: list[int], dim: int, sum_grads: bool):
        ctx.layout, ctx.sizes, ctx.dim, ctx.sum_grads = layout, sizes, dim, sum_grads
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, max(sizes) - x.shape[dim]]
        parts = [torch.empty_like(F.pad(x, pad)) for _ in sizes]
        dist.all_gather(parts, F.pad(x, pad).contiguous(), group=layout.group)  # gloo: equal sizes only
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.sum_grads:
            dist.all_reduce(grad, group=ctx.layout.group)
        start = sum(ctx.sizes[:ctx.layout.sp_rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.layout.sp_rank]), None, None, None, None


def encode_vision(model, prompts: list, device, layout: Layout | None) -> tuple[dict, int]:
    """rollout.encode_vision's output (same layout) and how many pieces this rank encoded. SP: the temporal patches of
    the distinct media of each modality are cut into sp_size contiguous runs, one per rank; a rank whose run is empty
    encodes the first temporal patch with weight 0 (FSDP2: every rank runs the tower the same number of times)."""
    if layout is None or layout.sp_size == 1:
        encoded = encode_vision_whole(model, prompts, device)
        return encoded, sum(len(where) for _, where in encoded.values())
    distinct = list({id(p): p for p in prompts}.values())
    merge2 = model.config.vision_config.spatial_merge_size ** 2
    out, count, n = {}, 0, layout.sp_size
    for kind, pixels, grid in MEDIA:
        mine = [p for p in distinct if pixels in p.mm]
        if not mine:
            continue
        pix, grids = torch.cat([p.mm[pixels] for p in mine]), torch.cat([p.mm[grid] for p in mine])
        patches = grids[:, 1:].prod(-1).tolist()                                  # per temporal patch, per item
        first_row = list(itertools.accumulate([t * hw for t, hw in zip(grids[:, 0].tolist(), patches)], initial=0))
        units = [(i, f) for i, t in enumerate(grids[:, 0].tolist()) for f in range(t)]     # (item, temporal patch)
        cuts = [len(units) * r // n for r in range(n + 1)]
        sizes = [sum(patches[i] for i, _ in units[a:b]) // merge2 for a, b in zip(cuts, cuts[1:])]   # tokens per rank
        run = units[cuts[layout.sp_rank]:cuts[layout.sp_rank + 1]] or units[:1]
        pieces = [list(g) for _, g in itertools.groupby(run, key=operator.itemgetter(0))]  # one item's patches each
        rows = torch.cat([pix[first_row[p[0][0]] + p[0][1] * patches[p[0][0]]:
                              first_row[p[0][0]] + (p[-1][1] + 1) * patches[p[0][0]]] for p in pieces])
        grid_thw = torch.tensor([[len(p)] + grids[p[0][0], 1:].tolist() for p in pieces])
        enc = getattr(model, f"get_{kind}_features")(rows.to(device), grid_thw.to(device), return_dict=True)
        count += len(pieces)
        items = (grids.prod(-1) // merge2).tolist()                               # tokens per item, in order
        levels = [enc.pooler_output] + list(getattr(enc, "deepstack_features", None) or [])
        full = []
        for level in levels:
            local = torch.cat(level)
            gathered = Gather.apply(local[:sizes[layout.sp_rank]], layout, sizes, 0, True)
            if not sizes[layout.sp_rank]:  # the stand-in patch: in the graph with weight 0
                gathered = gathered + 0.0 * local.sum()
            full.append(torch.split(gathered, items))
        fields = {"pooler_output": full[0]}
        if len(full) > 1:
            fields["deepstack_features"] = full[1:]
        starts = itertools.accumulate([len(p.mm[grid]) for p in mine], initial=0)
        out[kind] = (replace(enc, **fields), {id(p): range(s, s + len(p.mm[grid])) for p, s in zip(mine, starts)})
    return out, count


def group_rollouts(rollouts: list, baselines: list[float], prompts: list, n: int, layout: Layout) -> tuple[list, list]:
    """The SP group's rollouts and baselines, the same on each of its ranks: the ranks' generated parts (tokens,
    log-probs, text, finish; not the media) all-gathered in rank order and put on this rank's own Prompt objects
    (`prompts`: the group's, train.tp_share's order), n rollouts each."""
    from rollout import Rollout
    parts = [None] * layout.sp_size
    mine = [(r.response_ids, r.logp, r.text, r.finish) for r in rollouts]
    dist.all_gather_object(parts, (mine, baselines), group=layout.group)
    done = [x for part, _ in parts for x in part]
    return [Rollout(prompts[i // n], *x) for i, x in enumerate(done)], [b for _, part in parts for b in part]


def query_heads(model_dir: str) -> int:
    """The language model's attention heads, from the checkpoint's config (no weights loaded)."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_dir).get_text_config().num_attention_heads


def language_model(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft
    return base.model.language_model


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


@dataclass
class SeqShard:
    """What ulysses_attention reads in an SP forward (it travels through the model's **kwargs)."""
    layout: Layout
    mask: torch.Tensor   # the kernel's mask for the FULL padded sequence: sdpa (B, 1, S, S) bool, flash-attn (B, S)


class AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to rank j; chunk j of the result came from rank j. Its adjoint is itself."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # of the contiguous x: the collective writes it as one flat buffer
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    return AllToAll.apply(x, group)


def ulysses_attention(module, query, key, value, attention_mask, kernel: str, sp_shard: SeqShard | None = None, **kw):
    """q (B, H, S/n, d), k/v (B, Hkv, S/n, d) -> (B, S/n, H, d), the layout attention functions return. KV heads are
    repeated up to a multiple of n (GQA with Hkv < n, as verl), each rank attends with H/n heads over all S."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    inner = ALL_ATTENTION_FUNCTIONS[kernel]
    if sp_shard is None:
        return inner(module, query, key, value, attention_mask, **kw)
    group, n = sp_shard.layout.group, sp_shard.layout.sp_size
    B, H, s, d = query.shape
    rep = n // math.gcd(key.shape[1], n)
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    # (B, h, s, d) -> (n, B, h/n, s, d): head chunk j to rank j; back as rank j's positions -> (B, h/n, S, d)
    q, k, v = (all_to_all(x.unflatten(1, (n, -1)).transpose(0, 1), group).permute(1, 2, 0, 3, 4).flatten(2, 3)
               for x in (query, key, value))
    # what the kernel reads of the module, for this rank's heads (sdpa repeats KV heads by num_key_value_groups)
    heads = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=kernel), is_causal=True,
                                  layer_idx=module.layer_idx, num_key_value_groups=H // key.shape[1],
                                  training=module.training)
    out, _ = inner(heads, q, k, v, sp_shard.mask, **kw)                                     # (B, S, H/n, d)
    # (B, S, H/n, d) -> (n, B, s, H/n, d): positions of rank j to rank j; back as rank j's heads -> (B, s, H, d)
    back = all_to_all(out.unflatten(1, (n, s)).transpose(0, 1), group)
    return back.permute(1, 2, 0, 3, 4).flatten(2, 3), None


def kernel_mask(mask: torch.Tensor, kernel: str) -> torch.Tensor:
    """The padding mask (B, S) as the kernel takes it: sdpa a causal (B, 1, S, S) bool mask where padding queries see
    themselves (a row with no key is NaN, and NaN * 0 gradient is NaN); flash-attn the 2-D mask (it unpads)."""
    if kernel != "sdpa":
        return mask
    pos = torch.arange(mask.shape[1], device=mask.device)
    causal = pos[None, :] <= pos[:, None]                                                   # (S, S) key <= query
    return (causal & (mask.bool()[:, None, :] | (pos[None, :] == pos[:, None])))[:, None]


def shard_inputs(module, args, kwargs, start: int, size: int, padded: int, sp_shard: SeqShard):
    """Forward pre-hook of the language model: the full sequence's embeddings and positions (and Qwen3-VL's deepstack
    inputs) -> this rank's positions [start, start + size) of the sequence padded to `padded`."""
    emb = kwargs["inputs_embeds"]                                                            # (B, S, D)
    B, S, _ = emb.shape
    pos = kwargs.get("position_ids")                                                         # (3, B, S) M-RoPE
    if pos is None:  # text only: the model's own default, 0..S-1
        pos = torch.arange(S, device=emb.device).view(1, 1, -1).expand(3, B, -1)
    keep = slice(start, start + size)
    kwargs.update(inputs_embeds=F.pad(emb, (0, 0, 0, padded - S))[:, keep], attention_mask=None, sp_shard=sp_shard,
                  position_ids=F.pad(pos, (0, padded - S))[..., keep])
    visual = kwargs.get("visual_pos_masks")                                                  # (B, S) bool
    if visual is not None:
        visual = F.pad(visual, (0, padded - S))
        mine = torch.zeros_like(visual)
        mine[:, keep] = True
        kwargs["visual_pos_masks"] = visual[:, keep]
        kwargs["deepstack_visual_embeds"] = [e[mine[visual]] for e in kwargs["deepstack_visual_embeds"]]
    return args, kwargs


@dataclass
class Shard:
    """This rank's positions [start, stop) of a sequence of `length` tokens (sp_size 1: all of them)."""
    layout: Layout | None
    length: int
    start: int
    stop: int

    def response_span(self, R: int, start: int | None = None, stop: int | None = None) -> tuple[int, int]:
        """The response tokens j in [a, b) whose log-probs are predicted at positions this shard holds (token j of
        the last R is predicted at position length - R - 1 + j)."""
        first = self.length - R - 1
        a = min(max(self.start if start is None else start, first), self.length - 1) - first
        b = max(min(self.stop if stop is None else stop, self.length - 1) - first, a)
        return a, b

    def gather(self, x: torch.Tensor, R: int) -> torch.Tensor:
        """(b, r) of this rank's response span -> (b, R), the SP ranks' spans in order."""
        if self.layout is None or self.layout.sp_size == 1:
            return x
        size = self.stop - self.start
        spans = [self.response_span(R, j * size, (j + 1) * size) for j in range(self.layout.sp_size)]
        return Gather.apply(x, self.layout, [b - a for a, b in spans], 1, False)


@contextlib.contextmanager
def sequence_shard(model, attention_mask: torch.Tensor, layout: Layout | None):
    """Inside, a forward of `model` runs its language model on this rank's shard of the sequence, Ulysses attention
    over the full one; yields the Shard."""
    S = attention_mask.shape[1]
    if layout is None or layout.sp_size == 1:
        yield Shard(layout, S, 0, S)
        return
    size = -(-S // layout.sp_size)
    lm = language_model(model)
    mask = kernel_mask(F.pad(attention_mask, (0, size * layout.sp_size - S)),
                       lm.config._attn_implementation.removeprefix("ulysses_"))
    hook = functools.partial(shard_inputs, start=layout.sp_rank * size, size=size, padded=size * layout.sp_size,
                             sp_shard=SeqShard(layout, mask))
    handle = lm.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield Shard(layout, S, layout.sp_rank * size, (layout.sp_rank + 1) * size)
    finally:
        handle.remove()

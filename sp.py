"""sp.py: sequence parallelism for long videos (Ulysses). The world is dp x sp: an SP group of
sp_size consecutive ranks trains the same rows, each rank holding 1/sp_size of every sequence's
positions.

    vision     each rank holds and encodes its run of each prompt's temporal patches (the towers
               attend within one)
    embed      each rank embeds only its shard of the sequence (model_inputs): the M-RoPE positions
               of the whole, the features its positions hold, sent by the ranks that encoded them
               (one all-to-all)
    attention  "ulysses_<kernel>": all-to-all from position to head shards, the model's kernel,
               all-to-all back; heads that do not split over sp_size are padded with zero heads
               (dropped after)
    log-probs  each rank projects the response positions it holds; summed over the group, each
               rank's loss is whole
"""

import collections
import functools
import importlib
import itertools
import math
import os
import types
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cache
import data
from common import any_rank, base_model, gather

MEDIA = (
    ("image", "pixel_values", "image_grid_thw"),
    ("video", "pixel_values_videos", "video_grid_thw"),
)


@dataclass
class Share:
    """What a group of consecutive ranks works on (Layout.share), and this rank's own part of it."""

    items: list  # the same on the group's ranks
    start: int  # where this rank's part begins in items
    count: int  # its length

    def own(self) -> list:
        return self.items[self.start : self.start + self.count]


@dataclass
class Layout:
    """This rank's place in the dp x sp world and in its rollout engine's TP group: all the rank
    arithmetic. SP and TP groups are sp_size and tp consecutive ranks (tp divides sp_size, or
    sp_size is 1). A step's prompts are dealt so that every SP group gets its equal part in one
    round (part): the rows its ranks train together."""

    group: object  # the SP group's process group (None with sp_size 1)
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int
    tp: int = 1  # the rollout engine's tensor-parallel size
    rank: int = 0  # dp_rank * sp_size + sp_rank
    world: int = 1  # dp_size * sp_size
    # the SP group's gloo group: media pass between its ranks in host memory (group_rollouts)
    host: object = None
    tp_host: object = None  # the TP group's gloo group (rollout_tp > 1: share_prompts)

    def part(self, items: list, rank: int) -> list:
        """Rank `rank`'s own items: its SP group's part, items[g::dp_size] for the group g
        (prompts_per_step / dp_size of a step's), dealt in turn over the group's engines (1 <
        tp < sp_size: each generates its share, none idles), then over an engine's ranks.
        sp_size 1: items[rank::world]."""
        group = items[rank // self.sp_size :: self.dp_size]
        local = rank % self.sp_size
        if 1 < self.tp < self.sp_size:
            engines = self.sp_size // self.tp
            return group[local // self.tp :: engines][local % self.tp :: self.tp]
        return group[local :: self.sp_size]

    def share(self, items: list, size: int) -> "Share":
        """The list the group of `size` consecutive ranks around this one works on, the same on its
        ranks (size tp: what its engine generates), and where this rank's own part lies in it."""
        rank = self.rank
        first = rank - rank % size
        parts = [self.part(items, q) for q in range(first, first + size)]
        flat = [x for part in parts for x in part]
        start = sum(len(part) for part in parts[: rank - first])
        return Share(flat, start, len(parts[rank - first]))

    def prepares(self, i: int) -> bool:
        """Whether this rank prepares item i of a step's prompts: the one rank whose part holds it
        (a part of the first i + 1 items holds i as the whole list's does); share_prompts passes it
        to the rest of the TP group that generates it."""
        return i in self.part(range(i + 1), self.rank)

    def dedup(self, parts: list) -> list:
        """Per-rank objects gathered in rank order -> one per SP group (its ranks hold the same
        rows)."""
        return parts[:: self.sp_size]


def make_layout(sp_size: int, tp: int = 1) -> Layout:
    """Creates the SP process groups: new_group is collective, so every rank creates every group."""
    rank = 0
    world = 1
    if dist.is_initialized():
        rank = dist.get_rank()
        world = dist.get_world_size()
    groups = consecutive_groups(world, sp_size)
    hosts = consecutive_groups(world, sp_size, "gloo")
    tp_hosts = consecutive_groups(world, tp, "gloo")
    dp_rank = rank // sp_size
    return Layout(
        group=groups[dp_rank],
        sp_rank=rank % sp_size,
        sp_size=sp_size,
        dp_rank=dp_rank,
        dp_size=world // sp_size,
        tp=tp,
        rank=rank,
        world=world,
        host=hosts[dp_rank],
        tp_host=tp_hosts[rank // tp],
    )


def consecutive_groups(world: int, size: int, backend: str | None = None) -> list:
    """A process group per `size` consecutive ranks (None each for size 1), in rank order."""
    if size == 1:
        return [None] * world
    return [
        dist.new_group(list(range(s, s + size)), backend=backend) for s in range(0, world, size)
    ]


class AllReduce(torch.autograd.Function):
    """The sum over the SP group of tensors zero outside each rank's part; each rank computes the
    same loss from the sum, so the gradient passes as it is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_to_all(x: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
    """x's rows, send[j] of them to rank j in order -> the recv[j] rows from each rank j, in rank
    order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all with its own gradient (whatever the torch build registers): the same exchange,
    reversed."""

    @staticmethod
    def forward(ctx, x, group, send: list[int], recv: list[int]):
        ctx.group = group
        ctx.send = send
        ctx.recv = recv
        return all_to_all(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, ctx.recv, ctx.send), None, None, None


@dataclass
class Features:
    """One modality's encoder output for a set of prompts as this rank holds it (SP: the features
    of its own run of temporal patches), the model's levels (Qwen3-VL: + deepstack) side by side
    along the last dimension."""

    local: torch.Tensor  # (bounds[r + 1] - bounds[r], sum(dims))
    # rank j holds the features [bounds[j], bounds[j + 1]) of the ranks' runs one after another
    bounds: list[int]
    # (features,) each feature of the prompts' media in order: its index in the ranks' runs
    where: torch.Tensor
    spans: dict  # id(prompt) -> the index of its first feature
    dims: list[int]  # each level's width
    output: type  # the encoder output's class, which the model takes back (mm_encoder_outputs)
    own: dict  # id(prompt) -> the rows of local that hold this rank's run of its features (a slice)


@dataclass
class Vision:
    """encode_vision's result: the features of each modality encoded (a dummy's: none kept), and
    how many pieces this rank encoded."""

    kinds: dict
    encodes: int


def encode_vision(
    model, prompts: list, device, layout: Layout | None = None, dummies: dict | None = None
) -> Vision:
    """The vision tower, once per modality, over the distinct prompts' media (a group's rows share
    one Prompt). SP: each rank encodes its run of each prompt's temporal patches (runs) and keeps
    their features. dummies (data.dummy_prompts; FSDP2 with several ranks): a rank with no patch of
    a modality encodes its dummy, weight 0 (FSDP2 all-gathers the tower each time it runs: every
    rank must run it as often, in the same order)."""
    distinct = unique(prompts)
    r = layout.sp_rank if layout else 0
    n = layout.sp_size if layout else 1
    out = Vision({}, 0)
    for kind, pixels, grid in MEDIA:
        mine = [p for p in distinct if pixels in p.mm]
        if not mine and not dummies:
            continue
        grid_thw = []  # this rank's pieces: its run's temporal patches of each item, in order
        for p in mine:
            for i, count in runs(p.mm[grid], n).pieces(r).items():
                grid_thw.append([count, *p.mm[grid][i, 1:].tolist()])
        x = [run_rows(p, pixels, grid, r, n) for p in mine]
        if not grid_thw:  # no prompt has this modality, or this rank's runs are empty: the dummy
            x = [dummies[kind].mm[pixels]]
            grid_thw = dummies[kind].mm[grid].tolist()
        encode = getattr(model, f"get_{kind}_features")  # the model's own (Qwen3-VL: + deepstack)
        grid_thw = torch.tensor(grid_thw, device=device)
        enc = encode(torch.cat(x).to(device), grid_thw, return_dict=True)
        out.encodes += len(grid_thw)
        local = torch.cat([torch.cat(level) for level in levels(enc)], -1)
        dims = [level[0].shape[-1] for level in levels(enc)]
        out.kinds[kind] = features(model, mine, grid, local, dims, type(enc), layout)
    return out


def unique(prompts: list) -> list:
    """The distinct Prompt objects, in order (a group's rows share one)."""
    return list({id(p): p for p in prompts}.values())


def run_features(model, p, grid: str, n: int) -> list[int]:
    """Prompt p's features of one modality: where each of its n runs starts (and the end)."""
    merge2 = model.config.vision_config.spatial_merge_size**2
    run = runs(p.mm[grid], n)
    return [run.rows[c] // merge2 for c in run.cuts]  # a feature: merge2 pixel rows


def features(
    model, mine: list, grid: str, local: torch.Tensor, dims: list, output: type, layout
) -> Features:
    """The Features of the prompts `mine` (those with this modality), this rank's run of each
    one's features one after another in `local` (a dummy's: none kept, an empty slice in the graph
    as real features, grad 0: FSDP2's same backward order)."""
    r = layout.sp_rank if layout else 0
    n = layout.sp_size if layout else 1
    firsts = [run_features(model, p, grid, n) for p in mine]
    starts = list(itertools.accumulate([f[-1] for f in firsts], initial=0))
    # rank j holds the features of each prompt's run j, in prompt order
    held = [
        [i for s, f in zip(starts, firsts) for i in range(s + f[j], s + f[j + 1])] for j in range(n)
    ]
    bounds = list(itertools.accumulate(map(len, held), initial=0))
    order = torch.tensor([i for h in held for i in h], dtype=torch.long)
    counts = [f[r + 1] - f[r] for f in firsts]  # this rank's run of each prompt's features
    at = itertools.accumulate(counts, initial=0)
    return Features(
        local=local[: bounds[r + 1] - bounds[r]],
        bounds=bounds,
        where=torch.argsort(order).to(local.device),
        spans={id(p): s for p, s in zip(mine, starts)},
        dims=dims,
        output=output,
        own={id(p): slice(a, a + c) for p, a, c in zip(mine, at, counts)},
    )


@dataclass
class Tower:
    """Prompts through the trained tower once, with gradient (Towers): the features with the
    tower's graph, and the same features as leaves that the micro-batches read (their backward
    sums the features' gradient there), which backward_once takes through the tower once, instead
    of one encode per micro-batch a prompt's rows fall in."""

    encoded: Vision
    leaves: Vision
    prompts: list


def backward_once(tower: Tower):
    """The features' gradient, summed over the micro-batches that read tower.leaves, through the
    tower once (every rank: FSDP2 runs the tower's backward on all ranks alike)."""
    outputs = []
    grads = []
    for kind, f in tower.encoded.kinds.items():
        leaf = tower.leaves.kinds[kind].local
        if not f.local.requires_grad:
            continue
        outputs.append(f.local)
        grads.append(torch.zeros_like(f.local) if leaf.grad is None else leaf.grad)
        leaf.grad = None
    if outputs:
        torch.autograd.backward(outputs, grads)


class Towers:
    """A mini-batch's trained-tower encodes: each prompt through the tower once, with gradient,
    its micro-batches reading leaves that sum the features' gradient, taken through the tower once
    when the prompt's last micro-batch is done (the tower activations of the prompts in flight).
    FSDP2 needs every rank to run the tower as often, in the same order: so with one data-parallel
    group (its SP ranks hold the same rows, micro-batch for micro-batch); with several, each
    micro-batch encodes its own prompts and takes them back after its backward (a group over k
    micro-batches: k encodes, as before; the tower held unsharded over the mini-batch would lift
    this)."""

    def __init__(self, model, mini: list[list], device, layout: Layout | None, dummies):
        self.model = model
        self.device = device
        self.layout = layout
        self.dummies = dummies
        self.mini = mini  # each micro-batch's prompts
        # id(prompt) -> its last micro-batch
        self.last = {id(p): i for i, prompts in enumerate(mini) for p in prompts}
        self.open = []  # the Towers not yet taken through the tower
        self.leaves = {}  # id(prompt) -> its Tower's leaves
        self.encodes = 0

    def vision(self, i: int) -> Vision:
        """Micro-batch i's features (leaves), its new prompts encoded first."""
        prompts = unique(self.mini[i])
        new = [p for p in prompts if id(p) not in self.leaves]
        if new:
            encoded = encode_vision(self.model, new, self.device, self.layout, self.dummies)
            leaves = Vision({}, encoded.encodes)
            for kind, f in encoded.kinds.items():
                leaf = f.local.detach().requires_grad_(f.local.requires_grad)
                leaves.kinds[kind] = replace(f, local=leaf)
            self.encodes += encoded.encodes
            self.open.append(Tower(encoded, leaves, new))
            for p in new:
                self.leaves[id(p)] = leaves
        out = Vision({}, 0)
        for kind, pixels, grid in MEDIA:
            mine = [p for p in prompts if pixels in p.mm]
            have = [v.kinds[kind] for v in self.leaves.values() if kind in v.kinds]
            if not have or not mine and not self.dummies:
                continue
            parts = [self.piece(p, kind) for p in mine]
            local = torch.cat(parts + [have[0].local[:0]])
            out.kinds[kind] = features(
                self.model, mine, grid, local, have[0].dims, have[0].output, self.layout
            )
        return out

    def piece(self, p, kind: str) -> torch.Tensor:
        """This rank's run of prompt p's features of one modality: a view of its leaf."""
        f = self.leaves[id(p)].kinds[kind]
        return f.local[f.own[id(p)]]

    def backward(self, i: int):
        """After micro-batch i: the towers whose prompts are all done, through the tower (several
        data-parallel groups: this micro-batch's)."""
        if self.layout and self.layout.dp_size > 1:  # its prompts done: encoded again if met again
            for p in self.mini[i]:
                self.last[id(p)] = i
                self.leaves.pop(id(p), None)
        still = []
        for tower in self.open:
            if all(self.last[id(p)] <= i for p in tower.prompts):
                backward_once(tower)
            else:
                still.append(tower)
        self.open = still


def tower_trains(model) -> bool:
    """Whether the vision tower has a trained parameter (not freeze_vision; LoRA: its adapters)."""
    return any(p.requires_grad for p in vision_tower(model).parameters())


FEATURE_CACHE_BYTES = 8 * 2**30  # a FeatureCache's bound per rank (host memory; the planner's too)
FEATURE_FORMAT = "nvr1-features-v2"  # bump when stored features change: every older entry a miss


class FeatureCache:
    """A frozen tower's features per sample (the reference's: they never change), this rank's run
    of each prompt's, in host memory, at most max_bytes (the oldest dropped first, encoded again
    when seen again): the tower runs on a sample the first time this rank sees it. FSDP2: when any
    rank has a sample to encode, every rank runs the tower (a rank with none: its dummies, else its
    prompts again). folder (train.py's feature_cache_dir): also on disk, keyed like the frame cache
    (the media files' identity) plus `stamp` (the weights' digest, the media settings, dtype), one
    entry per sample, modality and run, written atomically with a checksum: a later run reads them
    instead of encoding; an entry that fails its checksum is encoded and written again."""

    def __init__(
        self, max_bytes: int = FEATURE_CACHE_BYTES, folder: str = "", stamp: dict | None = None
    ):
        self.max_bytes = max_bytes
        self.pieces = {}  # (sample id, modality, grid) -> its features (this rank's run)
        self.empty = {}  # modality -> Features of no prompt: the encoder output's shape and class
        self.bytes = 0
        self.folder = folder
        self.stamp = stamp or {}
        self.reads = 0  # pieces read from disk

    def key(self, p, kind: str, grid: str) -> tuple:
        return (p.sample["id"], kind, str(p.mm[grid].tolist()))

    def path(self, p, kind: str, grid: str, layout: Layout | None) -> str:
        """The disk entry of this rank's run of p's features of one modality."""
        files = [cache.identity(name) for name in data.media_paths(p.sample)]
        ident = dict(
            format=FEATURE_FORMAT,
            files=files,
            end=p.sample.get("video_end"),
            kind=kind,
            grid=p.mm[grid].tolist(),
            run=[layout.sp_rank, layout.sp_size] if layout else [0, 1],
            **self.stamp,
        )
        return cache.entry_file(self.folder, ident)

    def read(self, p, kind: str, grid: str, layout: Layout | None):
        """p's features from disk into memory; False where there is no good entry."""
        file = self.path(p, kind, grid, layout)
        if not os.path.exists(file):
            return False
        try:
            raw, meta = cache.read_entry(file)  # its checksum checked
            # the features' bytes: numpy has no bfloat16
            local = torch.from_numpy(raw).view(getattr(torch, meta["dtype"]))
        # torn, corrupt or edited, a field missing: encoded again
        except (ValueError, KeyError, AttributeError) as e:
            print(
                f"{file}: feature cache entry unreadable ({type(e).__name__}: {e}): encoded again"
            )
            return False
        if kind not in self.empty:  # the encoder output's shape and class, as keep learns them
            module, name = meta["output"].rsplit(".", 1)
            output = getattr(importlib.import_module(module), name)
            self.empty[kind] = Features(local[:0], [], None, {}, meta["dims"], output, {})
        self.pieces[self.key(p, kind, grid)] = local
        self.bytes += local.nbytes
        self.reads += 1
        return True

    def write(self, file: str, local: torch.Tensor, empty: Features):
        os.makedirs(os.path.dirname(file), exist_ok=True)
        meta = dict(
            dims=empty.dims,
            output=f"{empty.output.__module__}.{empty.output.__qualname__}",
            dtype=str(local.dtype).removeprefix("torch."),
        )
        cache.write_entry(file, local.contiguous().view(torch.uint8).numpy(), meta)

    def vision(
        self, model, prompts: list, device, layout: Layout | None = None, dummies=None
    ) -> Vision:
        """encode_vision's result for `prompts`, the tower run on the samples not kept yet."""
        distinct = unique(prompts)
        missing = []
        for p in distinct:
            # each modality's features kept, else read from disk (every one: a sample missing one is
            # encoded whole, its other entries read all the same)
            have = [
                self.key(p, kind, grid) in self.pieces
                or (self.folder and self.read(p, kind, grid, layout))
                for kind, pixels, grid in MEDIA
                if pixels in p.mm
            ]
            if not all(have):
                missing.append(p)
        encodes = 0
        if any_rank(bool(missing)):
            if not missing and not dummies:  # the tower runs on every rank
                missing = distinct
            fresh = encode_vision(model, missing, device, layout, dummies)
            encodes = fresh.encodes
            self.keep(fresh, missing, layout)
        out = Vision({}, encodes)
        for kind, pixels, grid in MEDIA:
            mine = [p for p in distinct if pixels in p.mm]
            if not mine and (not dummies or kind not in self.empty):
                continue
            empty = self.empty[kind]
            parts = [self.pieces[self.key(p, kind, grid)] for p in mine]
            local = torch.cat(parts + [empty.local]).to(device)
            out.kinds[kind] = features(model, mine, grid, local, empty.dims, empty.output, layout)
        self.trim()
        return out

    def keep(self, fresh: Vision, prompts: list, layout: Layout | None):
        """fresh's features, per prompt of `prompts` (what encode_vision encoded), to the host."""
        for kind, pixels, grid in MEDIA:
            if kind not in fresh.kinds:
                continue
            f = fresh.kinds[kind]
            self.empty[kind] = replace(f, local=f.local[:0].detach().to("cpu", copy=True))
            for p in [p for p in prompts if pixels in p.mm]:
                local = f.local[f.own[id(p)]]
                key = self.key(p, kind, grid)
                if key in self.pieces:  # encoded again (FSDP2): newest now
                    self.bytes -= self.pieces.pop(key).nbytes
                self.pieces[key] = local.detach().to("cpu", copy=True)
                self.bytes += local.nbytes
                if self.folder:
                    self.write(self.path(p, kind, grid, layout), self.pieces[key], self.empty[kind])

    def trim(self):
        """Drops the oldest samples' features over max_bytes (after the step's use of them)."""
        while self.bytes > self.max_bytes and self.pieces:
            oldest = next(iter(self.pieces))
            self.bytes -= self.pieces.pop(oldest).nbytes


@dataclass
class Runs:
    """One prompt's media of one modality in n runs of temporal patches (SP rank j's: run j)."""

    units: list[int]  # each temporal patch's item
    rows: list[int]  # each patch's first pixel row, and the end
    cuts: list[int]  # each run's first patch, and the end

    def pieces(self, j: int) -> dict:
        """Run j's items, in order, and how many of their temporal patches it holds."""
        return collections.Counter(self.units[self.cuts[j] : self.cuts[j + 1]])


def runs(grid: torch.Tensor, n: int) -> Runs:
    """The n runs of one prompt's media of one modality, grid (items, 3) t, h, w."""
    units = [i for i, t in enumerate(grid[:, 0].tolist()) for _ in range(t)]
    sizes = [int(grid[i, 1:].prod()) for i in units]
    rows = list(itertools.accumulate(sizes, initial=0))
    return Runs(units, rows, [len(units) * j // n for j in range(n + 1)])


def run_rows(p, pixels: str, grid: str, j: int, n: int) -> torch.Tensor:
    """Prompt p's pixel rows of run j of n (a view): p holds all of them, or (group_rollouts')
    that run's alone."""
    run = runs(p.mm[grid], n)
    if len(p.mm[pixels]) < run.rows[-1]:
        return p.mm[pixels]
    return p.mm[pixels][run.rows[run.cuts[j]] : run.rows[run.cuts[j + 1]]]


def levels(enc) -> list:
    """The encoder output's feature levels, each a tuple of per-item tensors: the merged features
    (+ deepstack)."""
    return [enc.pooler_output] + list(getattr(enc, "deepstack_features", None) or [])


def shard_features(model, vision: Vision, ids: torch.Tensor, prompts: list, shard) -> dict:
    """The model's mm_encoder_outputs for the positions [shard.start, shard.stop) of ids (B, S'),
    the rows of `prompts`: each modality's features of the placeholders there in row-major order
    (masked_scatter's). SP: each rank gets the features its positions need from the ranks that
    encoded them (one all-to-all, differentiable)."""
    n = shard.layout.sp_size if shard.layout else 1
    size = shard.stop - shard.start
    out = {}
    for kind, f in vision.kinds.items():
        placeholders = ids == getattr(model.config, f"{kind}_token_id")
        before = F.pad(placeholders.long().cumsum(-1), (1, 0)).tolist()
        # each row's first feature (a row without this modality has no placeholder)
        firsts = [f.spans.get(id(p), 0) for p in prompts]

        def needed(start: int) -> torch.Tensor:
            """The features of the placeholders in [start, start + size)."""
            index = [
                i for s, c in zip(firsts, before) for i in range(s + c[start], s + c[start + size])
            ]
            return torch.tensor(index, dtype=torch.long, device=f.local.device)

        if n == 1:
            x = f.local[needed(shard.start)]
        else:
            r = shard.layout.sp_rank
            need = [f.where[needed(j * size)] for j in range(n)]
            lo = f.bounds[r]
            hi = f.bounds[r + 1]
            send = [
                f.local[x[(x >= lo) & (x < hi)] - lo] for x in need
            ]  # what rank j needs of mine
            cuts = torch.tensor(f.bounds[1:n], device=f.local.device)
            owner = torch.searchsorted(cuts, need[r], right=True)
            recv = torch.bincount(owner, minlength=n).tolist()
            # by owner, each in need[r]'s order
            x = AllToAll.apply(torch.cat(send), shard.layout.group, [len(s) for s in send], recv)
            x = x[torch.argsort(torch.argsort(owner, stable=True))]
        parts = [(part,) for part in x.split(f.dims, -1)]
        fields = {"pooler_output": parts[0]}
        if len(parts) > 1:
            fields["deepstack_features"] = parts[1:]
        out[kind] = f.output(**fields)
    return out


def bare(p):
    """Prompt p without frames and with empty pixel rows (of their width): what group_rollouts
    passes around."""
    mm = {k: v[:0].clone() if k.startswith("pixel") else v for k, v in p.mm.items()}
    return replace(p, mm=mm, videos=[], images=[])


def holds_pixels(p) -> bool:
    """Whether p holds its pixel rows (share_prompts' copy on a TP peer holds its frames alone)."""
    return p is not None and all(len(v) for k, v in p.mm.items() if k.startswith("pixel"))


def share_round(own: list, layout: Layout) -> Share:
    """The TP group's prompts, its ranks' own lists in rank order (its engine takes the same prompts
    on every rank), and where this rank's lie in them: each prompt decoded and processed once, by the
    rank whose list holds it, which passes the others its text, token ids and uint8 frames; their
    copies' pixel rows stay empty (group_rollouts builds a rank's run from the frames): no fp32
    pixels pass."""
    if layout.tp == 1:
        return Share(own, 0, len(own))
    me = layout.rank % layout.tp
    first = layout.rank - me
    # the frames' shapes instead of the frames: they pass below, not pickled
    shapes = [
        replace(
            bare(p),
            videos=[(frames.shape, meta) for frames, meta in p.videos],
            images=[im.shape for im in p.images],
        )
        for p in own
    ]
    parts = gather(shapes, layout.tp_host)
    parts[me] = own
    for q, part in enumerate(parts):
        for k, p in enumerate(part):
            if q != me:  # frames to receive
                videos = [(np.empty(shape, np.uint8), meta) for shape, meta in p.videos]
                p = replace(p, videos=videos, images=[np.empty(s, np.uint8) for s in p.images])
                part[k] = p
            for frames in [f for f, _ in p.videos] + p.images:
                dist.broadcast(torch.from_numpy(frames), first + q, group=layout.tp_host)
    start = sum(len(part) for part in parts[:me])
    return Share([p for part in parts for p in part], start, len(own))


def share_prompts(prompts: list, layout: Layout) -> list:
    """A step's prompts (data.next_valid's: each prepared by the one rank whose part holds it,
    Layout.prepares; None elsewhere) with its TP group's filled in (share_round)."""
    index = layout.share(list(range(len(prompts))), layout.tp)
    shared = share_round([prompts[i] for i in index.own()], layout)
    out = list(prompts)
    for i, p in zip(index.items, shared.items):
        out[i] = p
    return out


def build_run(processor, p, j: int, n: int) -> dict:
    """Prompt p's pixel rows of run j of n, built from its uint8 frames by the processor as
    data.prepare's (the same rows, bit for bit: tests/test_sp.py): {pixels key: rows}."""
    out = {}
    step = processor.video_processor.temporal_patch_size  # frames per temporal patch
    for kind, pixels, grid in MEDIA:
        if pixels not in p.mm:
            continue
        run = runs(p.mm[grid], n)
        pieces = [p.mm[pixels][:0]]
        at = run.cuts[j]  # the run's patches, item by item
        for i, count in run.pieces(j).items():
            if kind == "image":  # one patch, the image
                image = torch.from_numpy(p.images[i]).movedim(-1, -3)
                x = processor.image_processor(images=[image], do_resize=False, return_tensors="pt")
            else:
                a = at - run.units.index(i)  # the item's first patch in the run
                frames = torch.from_numpy(p.videos[i][0][a * step : (a + count) * step])
                x = processor.video_processor(
                    videos=[frames.movedim(-1, -3)],
                    do_resize=False,
                    do_sample_frames=False,
                    return_tensors="pt",
                )
            pieces.append(x[pixels])
            at += count
        out[pixels] = torch.cat(pieces)
    return out


def group_runs(prompts: list, layout: Layout, processor=None) -> list:
    """The SP group's prompts (Layout.share's: the prompt where this rank prepared it,
    share_prompts' frames alone where its TP group did, else None), the same on its ranks, each
    holding this rank's run of pixel rows (runs) alone, no frames: built from the frames, else a
    copy of the rank's own, else sent by the first rank that prepared it, in host memory."""
    r = layout.sp_rank
    size = layout.sp_size
    first = layout.rank - layout.sp_rank
    whole = [bare(p) if holds_pixels(p) else None for p in prompts]
    has = [p is not None for p in prompts]
    parts = gather((whole, has), layout.host)
    works = []
    group = []
    for k, p in enumerate(prompts):
        src = next(q for q in range(size) if parts[q][0][k] is not None)
        group.append(parts[src][0][k])  # its pixel rows: empty, of their width, till below
        mm = group[k].mm
        built = {}
        if p is not None and not holds_pixels(p):
            built = build_run(processor, p, r, size)
        for m, (_, pixels, grid) in enumerate(MEDIA):
            if pixels not in mm:
                continue
            tag = 2 * k + m
            if pixels in built:
                mm[pixels] = built[pixels]
                continue
            if p is None:  # this rank's run, from src
                run = runs(mm[grid], size)
                length = run.rows[run.cuts[r + 1]] - run.rows[run.cuts[r]]
                mm[pixels] = mm[pixels].new_empty(length, mm[pixels].shape[1])
                works.append(dist.irecv(mm[pixels], first + src, layout.host, tag=tag))
                continue
            # a copy of this rank's run (the whole is freed); src sends the others theirs
            mm[pixels] = run_rows(p, pixels, grid, r, size).clone()
            if src != r:
                continue
            for j in range(size):
                if not parts[j][1][k]:  # neither its pixels nor its frames
                    rows = run_rows(p, pixels, grid, j, size)
                    works.append(dist.isend(rows, first + j, layout.host, tag=tag))
    for work in works:
        work.wait()
    return group


def group_rollouts(
    rollouts: list, baselines: list[float], group: list, n: int, layout: Layout
) -> tuple[list, list]:
    """The SP group's rollouts and baselines, the same on its ranks (the ranks' parts in rank
    order), n per prompt of `group` (group_runs')."""
    mine = ([replace(x, prompt=None) for x in rollouts], baselines)
    parts = gather(mine, layout.host)
    done = [x for part, _ in parts for x in part]
    grouped = [replace(x, prompt=group[i // n]) for i, x in enumerate(done)]
    return grouped, [b for _, part in parts for b in part]


def language_model(model):
    """The decoder (Omni's thinker: model.model itself)."""
    inner = base_model(model).model
    return getattr(inner, "language_model", inner)


def vision_tower(model):
    """The vision tower (Omni's thinker holds it beside its decoder and audio tower)."""
    m = base_model(model)
    if hasattr(m, "audio_tower"):
        return m.visual
    return m.model.visual


def use_ulysses(model):
    """Registers "ulysses_<kernel>" (attention and its mask function) and sets it on the language
    model: outside an SP forward it is the kernel itself, so generation and single-sequence
    forwards are unchanged."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    config = language_model(model).config
    kernel = config._attn_implementation.removeprefix("ulysses_")
    attention = functools.partial(ulysses_attention, kernel=kernel)
    AttentionInterface.register(f"ulysses_{kernel}", attention)
    AttentionMaskInterface.register(f"ulysses_{kernel}", ALL_MASK_ATTENTION_FUNCTIONS[kernel])
    config._attn_implementation = f"ulysses_{kernel}"


def redistribute(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(B, a, b, d) -> (B, a/n, n b, d): chunk j of dim 1 to rank j, the chunks received along dim 2
    in rank order. Heads to ranks: (B, h, s, d) -> (B, h/n, S, d); positions back to their ranks:
    (B, S, h/n, d) -> (B, s, h, d)."""
    chunks = x.unflatten(1, (n, -1)).transpose(0, 1)  # (n, B, h/n, s, d)
    y = AllToAll.apply(chunks, group, [1] * n, [1] * n)
    return y.permute(1, 2, 0, 3, 4).flatten(2, 3)


def ulysses_attention(module, query, key, value, attention_mask, kernel: str, sp_shard=None, **kw):
    """q (B, H, S/n, d), k/v (B, Hkv, S/n, d) -> (B, S/n, H, d), the layout attention functions
    return. Each rank attends with H/n heads over all S: KV heads are repeated up to a multiple of
    n (GQA with Hkv < n, as verl); H not a multiple of n: every query head gets its own KV head and
    zero heads pad H (their output, zero, is dropped). sp_shard (a Shard, through the model's
    **kwargs): None outside an SP forward, then it is the kernel itself."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[kernel]
    if sp_shard is None:
        return inner(module, query, key, value, attention_mask, **kw)
    group = sp_shard.layout.group
    n = sp_shard.layout.sp_size
    H = query.shape[1]
    pad = -H % n
    rep = H // key.shape[1] if pad else n // math.gcd(key.shape[1], n)
    padding = (0, 0, 0, 0, 0, pad)
    q = redistribute(F.pad(query, padding), group, n)
    k = redistribute(F.pad(key.repeat_interleave(rep, 1), padding), group, n)
    v = redistribute(F.pad(value.repeat_interleave(rep, 1), padding), group, n)
    # what the kernel reads of the module, for this rank's heads (sdpa repeats KV heads by
    # num_key_value_groups)
    heads = types.SimpleNamespace(
        config=types.SimpleNamespace(_attn_implementation=kernel),
        is_causal=True,
        layer_idx=module.layer_idx,
        num_key_value_groups=q.shape[1] // k.shape[1],
        training=module.training,
    )
    out, _ = inner(heads, q, k, v, sp_shard.mask, **kw)  # (B, S, H'/n, d)
    return redistribute(out, group, n)[:, :, :H], None  # (B, s, H, d)


def kernel_mask(mask: torch.Tensor, kernel: str) -> torch.Tensor:
    """The padding mask (B, S) as the kernel takes it: sdpa a causal (B, 1, S, S) bool mask where
    padding queries see themselves (a row with no key is NaN, and NaN * 0 gradient is NaN);
    flash-attn the 2-D mask (it unpads)."""
    if kernel != "sdpa":
        return mask
    pos = torch.arange(mask.shape[1], device=mask.device)
    causal = pos[None, :] <= pos[:, None]  # key <= query
    visible = mask.bool()[:, None, :] | (pos[None, :] == pos[:, None])  # a token, or the query
    return (causal & visible)[:, None]


@dataclass
class Shard:
    """This rank's positions [start, stop) of a sequence of `length` tokens (sp_size 1: all of
    them), and the kernel's mask for the whole sequence padded to a multiple of sp_size (sdpa
    (B, 1, S, S) bool, flash-attn (B, S)); None without padding: the kernel's causal mode, no
    O(S^2) mask (no token sees the tail padding)."""

    layout: Layout | None
    length: int
    start: int
    stop: int
    mask: torch.Tensor | None = None

    def response_span(self, R: int) -> tuple[int, int]:
        """The response tokens [a, b) of the last R predicted in this shard (token j at position
        length - R - 1 + j)"""
        first = self.length - R - 1
        a = min(max(self.start, first), self.length - 1) - first
        return a, max(min(self.stop, self.length - 1) - first, a)

    def gather(self, x: torch.Tensor, R: int) -> torch.Tensor:
        """(b, r) of this rank's response span -> (b, R), the SP group's spans together."""
        if self.layout is None or self.layout.sp_size == 1:
            return x
        a, b = self.response_span(R)
        return AllReduce.apply(F.pad(x, (a, R - b)), self.layout.group)


@dataclass
class GridStep:
    """One time step of a media item in merged patches, and its M-RoPE time units per step."""

    h: int
    w: int
    scale: float


def mrope_positions(ids: torch.Tensor, mask: torch.Tensor, grids: dict, config) -> torch.Tensor:
    """M-RoPE positions (3, B, S) of rows ids (B, S), padded either side (mask; padding at 0), by
    the rule the Qwen-VL models were trained with and vLLM samples with: text counts up on all
    three axes (time, row, column); a run of placeholders (an image, a video's frame pairs;
    Qwen3-VL: a frame pair between timestamps) adds its grid index to the next position, time
    scaled by tokens_per_second x second_per_grid_ts (Qwen2.5-VL; Omni: position_id_per_seconds),
    and the text after it resumes at its LARGEST position + 1 (transformers 5.19 at max(rows,
    columns), ignoring time: LOG.md session 5). Omni's TMRoPE: a video's soundtrack tokens,
    interleaved with its frames' (Qwen2.5-Omni: in 2 s chunks; Qwen3-Omni: token by token in time
    order), count up from the video's own start, one position per audio token, as the frames'
    time does (position_id_per_seconds: 25, Qwen3-Omni 13); a lone audio's, as text."""
    merge = config.vision_config.spatial_merge_size
    omni_tps = getattr(config, "position_id_per_seconds", 1)
    tps = getattr(config.vision_config, "tokens_per_second", omni_tps)
    images = grids.get("image_grid_thw", torch.zeros(0, 3)).tolist()
    videos = grids.get("video_grid_thw", torch.zeros(0, 3)).tolist()
    seconds = grids.get("second_per_grid_ts", torch.ones(len(videos))).tolist()
    # each placeholder token's frame pairs in order: (rows, columns, time scale)
    pairs = {config.image_token_id: [], config.video_token_id: []}
    for t, h, w in images:
        pairs[config.image_token_id] += [GridStep(h // merge, w // merge, 1)] * t
    for (t, h, w), sec in zip(videos, seconds):
        pairs[config.video_token_id] += [GridStep(h // merge, w // merge, sec * tps)] * t
    # which run a token belongs to (None: text); audio joins its video's run
    runs = {token: token for token in pairs}
    audio_id = getattr(config, "audio_token_id", -1)  # -1: none (Qwen-VL)
    runs[audio_id] = config.video_token_id
    qwen3 = config.model_type.startswith("qwen3_omni")
    mask = mask.bool().cpu()
    pos = torch.zeros(3, *ids.shape, dtype=torch.long)
    for b, (row, keep) in enumerate(zip(ids.tolist(), mask.tolist())):
        parts = []
        start = 0
        tokens = itertools.compress(row, keep)
        for token, run in itertools.groupby(tokens, runs.get):
            run = torch.tensor(list(run))
            n = len(run)
            # text's and a soundtrack's tokens count up one by one: the j-th at j on all three axes
            audio = (run == audio_id) | (token is None)  # (n,)
            part = (audio.cumsum(0) - 1).expand(3, n).clone()  # (3, n)
            if not audio.all():
                item = pairs[token][0]
                # floored as vLLM does
                steps = int((~audio).sum()) // (item.h * item.w)
                time = (torch.arange(steps, dtype=torch.float64) * item.scale).long()
                grid = torch.cartesian_prod(time, torch.arange(item.h), torch.arange(item.w))
                part[:, ~audio] = grid.T  # (3, t h w)
                del pairs[token][: len(time)]
            part = part + start
            interleaved = audio.any() and not audio.all()  # a video with its soundtrack
            if interleaved and qwen3:
                # vLLM 0.32 lays Qwen3-Omni's block in the order of the FLOORED frame times (a
                # frame first on a tie), whatever token holds each position; the processor
                # orders the tokens by the unfloored times
                part = part[:, (part[0] * 2 + audio).argsort(stable=True)]
            elif interleaved:
                # vLLM 0.32 lays a video's interleaved block from its placeholder's offset, the
                # <|audio_bos|> before it: one token early, the last token resuming as text
                part = part - 1
                parts[-1][:, -1] = part[:, 0]
                part = torch.cat([part[:, 1:], part.max().expand(3, 1) + 1], 1)
            parts.append(part)
            start = int(parts[-1].max()) + 1
        pos[:, b, mask[b]] = torch.cat(parts, 1)
    return pos.to(ids.device)


def audio_inputs(grids: dict) -> dict:
    """Omni: the rows' soundtracks (log-mel features and their masks, data.grids'), which the model
    encodes in its forward (sequence parallelism refuses them: check_config)."""
    return {k: grids[k] for k in ("input_features", "feature_attention_mask") if k in grids}


def model_inputs(model, batch, vision: Vision, layout: Layout | None) -> tuple[dict, Shard]:
    """The model's inputs for this rank's positions of a micro-batch (a train.MicroBatch), and which
    they are: sp_size 1 the whole sequence; else this rank's shard of it padded to a multiple of
    sp_size: its token ids, the M-RoPE positions of the whole sequence there, the features its
    placeholders hold, and Ulysses' mask (Shard) to attend over all of it. No padding, no mask: a
    1-row micro-batch is the kernel's causal mode on every path. The positions are always ours
    (mrope_positions), never the model's: those the sampler uses."""
    ids = batch.input_ids
    mask = batch.attention_mask
    S = ids.shape[1]
    pos = mrope_positions(ids, mask, batch.grids, model.config)  # (3, B, S)
    if layout is None or layout.sp_size == 1:
        shard = Shard(layout, S, 0, S)
        inputs = dict(
            input_ids=ids,
            attention_mask=None if mask.all() else mask,
            position_ids=pos,
            **audio_inputs(batch.grids),
        )
    else:
        size = -(-S // layout.sp_size)
        tail = size * layout.sp_size - S
        shard = Shard(layout, S, layout.sp_rank * size, (layout.sp_rank + 1) * size)
        if not mask.all():
            kernel = language_model(model).config._attn_implementation.removeprefix("ulysses_")
            shard.mask = kernel_mask(F.pad(mask, (0, tail)), kernel)
        ids = F.pad(ids, (0, tail))
        keep = slice(shard.start, shard.stop)
        inputs = dict(
            input_ids=ids[:, keep],
            position_ids=F.pad(pos, (0, tail))[..., keep],
            attention_mask=None,
            sp_shard=shard,
        )
    inputs["mm_encoder_outputs"] = shard_features(model, vision, ids, batch.prompts, shard)
    return inputs, shard

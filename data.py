"""data.py: samples in, model-ready prompts out (the sample schema: FIELDS below).

load_samples(path)     JSON/JSONL -> list of validated sample dicts (errors name file:line, sample and field)
render_prompt(sample)  sandboxed Jinja2 template per problem type -> user text
render_all(t, samples) a user template rendered once per sample at load, bounded in time, memory and output
prepare(sample, ...)   frames (via cache.py) + chat template + processor -> Prompt, which hands the very same
                       pixels, decoded once, to vLLM and to the trainer
"""

import json
import os
import re
import resource
import sys
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from PIL import Image
from jinja2.sandbox import ImmutableSandboxedEnvironment

import cache
import rewards
from cache import Media
from common import UserError, gather, print0

# The sample schema (EasyVideoR1-compatible; one JSON object per line): each field's type, checked by validate_sample
FIELDS = {
    "problem": str,  # the question; <video>/<image> markers in it place the media
    "answer": str,  # ground truth (grounding answers are JSON strings, see rewards.py)
    "problem_type": str,  # routes the prompt template and the reward (rewards.canonical_type)
    "videos": list,  # video paths, relative to the JSONL's folder (optional)
    "images": list,  # image paths (optional)
    "data_type": str,  # "video" | "image" | "text" (optional; checked against the media given)
    "options": list,  # "A. red", ... for multiple choice
    "video_end": float,  # seconds: the videos are cut there (OVO-Bench: the question's moment; optional)
    "offline_output": str,  # a curated trajectory for mixed offline-online training (optional)
    "id": str,  # optional; defaults to "<file>:<line>"
}
REQUIRED = ("problem", "answer", "problem_type")
# The media placeholders and brackets (Qwen-VL's, then Omni's): never sampled by either engine
MEDIA_TOKENS = tuple(
    "<|image_pad|> <|video_pad|> <|vision_pad|> <|vision_start|> <|vision_end|> "  # Qwen-VL's
    "<|IMAGE|> <|VIDEO|> <|AUDIO|> <|vision_bos|> <|vision_eos|> <|audio_bos|> <|audio_eos|> "  # Omni's
    "<|audio_pad|> <|audio_start|> <|audio_end|>".split()  # Qwen3-Omni's
)
# Qwen2/2.5/3-VL's and Omni's special tokens, refused in sample text before any model loads (prepare() checks the
# loaded tokenizer's own): in a problem or an offline_output they forge chat turns or media placeholders.
SPECIAL_TOKENS = (
    tuple(
        "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
        "<|box_end|> <|quad_start|> <|quad_end|>".split()
    )
    + MEDIA_TOKENS
)
# a rendered prompt longer than this is refused (far above any max_prompt_len)
MAX_PROMPT_CHARS = 1_000_000
TEMPLATE_MEMORY = 1 << 30  # render_all: bytes the rendering may allocate


class DataError(UserError):
    """A sample that breaks the schema; the message names file, line, sample id and field."""


def validate_sample(s, where: str, special_tokens=SPECIAL_TOKENS) -> dict:
    """Check one raw sample, resolve media paths relative to `where`'s folder. Returns the sample,
    with its id, data_type and "where" (file:line)."""
    if not isinstance(s, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(s).__name__}")
    # printable despite a lone surrogate
    sid = str(s.get("id", where)).encode("utf-8", "backslashreplace").decode()
    who = f"{where}: sample {sid}"
    for k in REQUIRED:
        if k not in s:
            raise DataError(f"{who}: missing field '{k}'")
    for k, v in s.items():
        if k in FIELDS and not isinstance(v, FIELDS[k]):
            raise DataError(
                f"{who}: field '{k}' must be {FIELDS[k].__name__}, got {type(v).__name__}"
            )
        if FIELDS.get(k) is list and not all(isinstance(x, str) and x for x in v):
            raise DataError(f"{who}: field '{k}' must be a list of non-empty strings")
    check_text(s, who, special_tokens)
    # image + video in one sample (Video-MMMU style): routed as video, declared as either
    kinds = [kind for kind in ("video", "image") if s.get(kind + "s")] or ["text"]
    data_type = s.get("data_type", kinds[0])
    if data_type not in kinds:
        raise DataError(
            f"{who}: field 'data_type' says {data_type!r}, the sample has {' and '.join(kinds)} media"
        )
    place = where.encode("utf-8", "backslashreplace").decode()  # file:line, printable
    s = dict(s, id=sid, data_type=data_type, where=place)
    root = os.path.dirname(os.path.abspath(where.rsplit(":", 1)[0]))
    for k in ("videos", "images"):
        if k in s:
            s[k] = [os.path.join(root, p) for p in s[k]]  # an absolute p stays p
    # ground truth is checked now, not discovered broken at reward time
    try:
        rewards.validate_answer(s)
    except ValueError as e:
        raise DataError(f"{who}: field 'answer': {e}") from e
    return s


def check_text(sample: dict, who: str, special_tokens) -> None:
    """Every text field (strings and lists of strings, offline_output included): a lone surrogate (JSON's "\\ud800"),
    which no tokenizer encodes, or a special token of the model is a DataError naming `who` and the field."""
    refused = re.compile("|".join(["[\ud800-\udfff]"] + [re.escape(t) for t in special_tokens]))
    for k, v in sample.items():
        for text in v if isinstance(v, list) else [v]:
            bad = isinstance(text, str) and refused.search(text)
            if bad:
                raise DataError(
                    f"{who}: field '{k}' contains {bad[0]!r} at character {bad.start()}: a lone surrogate "
                    "or a special token of the model"
                )


def parse_json(raw: bytes, where: str):
    """bytes -> JSON value; bytes that are not UTF-8, malformed JSON, nesting deeper than Python's stack or an
    integer over 4300 digits are a DataError naming `where` (so skip_invalid can skip the line)."""
    try:
        return json.loads(raw.decode("utf-8"))
    # UnicodeDecodeError and JSONDecodeError are ValueErrors
    except (ValueError, RecursionError) as e:
        raise DataError(f"{where}: unparseable JSON ({type(e).__name__}: {str(e)[:200]})") from e


def load_samples(
    path: str,
    skip_invalid: bool = False,
    skipped: list | None = None,
    special_tokens=SPECIAL_TOKENS,
    allow_outside: bool = False,
    check_media: bool = True,
    need: str = "",
) -> list[dict]:
    """Read a .json (array) or .jsonl file; each sample gets its "where" (file:line). A bad sample
    raises DataError, or with skip_invalid is appended to `skipped` as {"where", "error"} (counted
    and logged by the caller, never silently dropped). special_tokens: the strings refused in any
    text field (the tokenizer's, when the caller has it loaded). A media path resolving outside the
    file's folder is a bad sample unless allow_outside. check_media: the samples naming a media file
    that is not there are one error (skip_invalid: skipped) now, not each when drawn, hours later.
    Ids that several samples share get their place appended (unique_ids). need: a field every
    sample must fill (train.py's SFT: offline_output)."""
    # bytes: a line that is not UTF-8 is an error on that line, not on the file
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".json"):
        items = parse_json(raw, path)
        if not isinstance(items, list):
            raise DataError(f"{path}: expected a JSON array of samples, got {type(items).__name__}")
        rows = [(f"{path}:{n}", item) for n, item in enumerate(items, start=1)]
    else:
        lines = enumerate(raw.split(b"\n"), start=1)
        rows = [(f"{path}:{n}", line) for n, line in lines if line.strip()]
    root = os.path.dirname(os.path.abspath(path))
    out = []
    missing = []  # skip reports of the samples naming a media file that is not there
    for where, row in rows:
        try:
            if isinstance(row, bytes):
                row = parse_json(row, where)
            s = validate_sample(row, where, special_tokens)
            if need and not s.get(need):
                raise DataError(
                    f"{where}: sample {s['id']}: {need}: missing, and this run trains on it"
                )
            if not allow_outside:
                check_inside(s, root, f"{where}: sample {s['id']}")
        except DataError as e:
            if not skip_invalid:
                raise
            if skipped is not None:
                skipped.append({"where": where, "error": str(e)})
            continue
        absent = missing_media(s) if check_media else []
        if absent:
            error = f"{where}: sample {s['id']}: {absent[0]}: not found (or not a regular file)"
            missing.append({"where": where, "media": absent, "error": error})
        else:
            out.append(s)
    if missing:
        first = "; ".join(f"{r['where']}: {r['media'][0]}" for r in missing[:3])
        more = ", ..." if len(missing) > 3 else ""
        summary = f"{path}: {len(missing)} samples name a media file that is missing or not a regular file"
        if not skip_invalid:
            raise DataError(f"{summary} ({first}{more}): fix the paths, or pass --skip-invalid")
        warn(f"warning: {summary}: skipped ({first}{more})")
        if skipped is not None:
            skipped += missing
    return unique_ids(out, path)


def check_inside(s: dict, root: str, who: str):
    """A media path that resolves (symlinks followed) outside `root` is a DataError naming `who` and
    the field: a hostile file must not read /etc/... or ~/.ssh/... as a "video". root: the data
    file's folder, or the benchmark's video folder."""
    top = os.path.realpath(root)
    for k in ("videos", "images"):
        for p in s.get(k, []):
            real = os.path.realpath(p)
            if os.path.commonpath([top, real]) != top:
                raise DataError(
                    f"{who}: field '{k}': {p} resolves to {real}, outside {top} (media are read "
                    "from the data's own folder; --allow-outside-media allows other paths)"
                )


def missing_media(s: dict) -> list[str]:
    """The sample's media paths that are not regular files (missing, a folder, a FIFO, a device): a
    stat each."""
    return [p for p in media_paths(s) if not os.path.isfile(p)]


def media_paths(s: dict) -> list[str]:
    """The sample's videos, then its images."""
    return s.get("videos", []) + s.get("images", [])


def unique_ids(samples: list[dict], name: str) -> list[dict]:
    """The samples, those whose id others share renamed `id@<file>:<line>` (their "where"), with one
    warning line: LiveSports-3K repeats ids for different questions, and a resume log, skip reports
    and eval rows key by id."""
    counts = Counter(s["id"] for s in samples)
    out = []
    renamed = []
    for s in samples:
        if counts[s["id"]] > 1:
            path, at = s["where"].rsplit(":", 1)  # a nested release's key path may hold "/"
            s = dict(s, id=f"{s['id']}@{os.path.basename(path)}:{at}")
            renamed.append(f"{s['where']} -> {s['id']}")
        out.append(s)
    if renamed:
        more = ", ..." if len(renamed) > 3 else ""
        warn(
            f"warning: {name}: {len(renamed)} samples share their id with another, now unique: "
            f"{', '.join(renamed[:3])}{more}"
        )
    return out


def warn(text: str):
    """A warning (or progress) line on stderr, flushed, once (rank 0's) under torchrun."""
    print0(text, file=sys.stderr)


# Prompts: one Jinja2 template per problem type, rendered in a sandbox (templates may come from users).
# The instruction follows the format the reward checks (train.Config.response_format): one setting, not two.
INSTRUCTIONS = {
    "answer": "Put your final answer inside <answer> </answer> tags.",
    "think_answer": "First think step by step inside <think> </think> tags, then put your final answer "
    "inside <answer> </answer> tags.",
}
TEMPLATES = {
    "multiple choice": "{{ problem }}\nOptions:\n{{ options | join('\n') }}\nAnswer with the option's letter. "
    "{{ instruction }}",
    **dict.fromkeys(
        ("numerical", "counting", "regression"),
        "{{ problem }}\nAnswer with a single number. {{ instruction }}",
    ),
    "boolean": "{{ problem }}\nAnswer yes or no. {{ instruction }}",
    "temporal grounding": '{{ problem }}\nAnswer with {"time": [start, end]} in seconds. {{ instruction }}',
    "spatial grounding": '{{ problem }}\nAnswer with the box, {"boxes": [x1, y1, x2, y2]}. {{ instruction }}',
    "default": "{{ problem }}\n{{ instruction }}",
}
_jinja = ImmutableSandboxedEnvironment(autoescape=False, keep_trailing_newline=False)
# render_all renders one template on every sample
compiled = lru_cache(maxsize=16)(_jinja.from_string)


def render_prompt(
    sample: dict, template: str | None = None, response_format: str = "answer"
) -> str:
    """The user text for a sample. `template` (Jinja2 source) overrides the per-type default; `{{ instruction }}` in it
    is the sentence that asks for the response format. Output over MAX_PROMPT_CHARS is a DataError naming the sample,
    caught while it streams (never built whole). A sample render_all has rendered: its text, at no cost."""
    if "prompt_text" in sample:
        return sample["prompt_text"]
    ptype = rewards.canonical_type(sample["problem_type"])
    src = template or TEMPLATES.get(ptype, TEMPLATES["default"])
    context = {**sample, "problem_type": ptype, "instruction": INSTRUCTIONS[response_format]}
    parts = []
    size = 0
    for part in compiled(src).generate(context):
        size += len(part)
        if size > MAX_PROMPT_CHARS:
            raise DataError(
                f"sample {sample.get('id')}: the prompt renders over {MAX_PROMPT_CHARS} characters"
            )
        parts.append(part)
    return "".join(parts)


def render_all(
    template: str,
    samples: list[dict],
    response_format: str = "answer",
    skipped: list | None = None,
    seconds: float = 2.0,
    where: str = "",
) -> list[dict]:
    """The samples, each with the template's text as "prompt_text" (render_prompt's from then on), rendered once in a
    forked child bounded in time (`seconds` a sample), memory (TEMPLATE_MEMORY) and output (MAX_PROMPT_CHARS). Loops of
    loops, 9**(9**9) or 'x' * 10**10 on sample k: the child is killed (whatever C code it is stuck in), and a DataError
    names the template (`where`) and sample k, or with `skipped` a skip report."""
    import multiprocessing

    def render_in_child(todo: list):
        """Sends (text, None) or (None, error) a sample, in a capped address space."""
        with open("/proc/self/statm") as f:
            inherited = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = inherited + TEMPLATE_MEMORY
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        for sample in todo:
            try:
                send.send((render_prompt(sample, template, response_format), None))
            except Exception as e:  # noqa: BLE001  MemoryError, SecurityError, undefined names...: all go to the parent
                send.send((None, f"{type(e).__name__}: {str(e)[:300]}"))

    out = []
    child = None  # the process rendering now
    children = []  # every one started
    try:
        for k, sample in enumerate(samples):
            # the first sample, or the first after a failed one (its child is killed)
            if child is None:
                recv, send = multiprocessing.Pipe(duplex=False)
                child = multiprocessing.get_context("fork").Process(
                    target=render_in_child, args=(samples[k:],)
                )
                child.start()
                children.append(child)
                send.close()  # the child's copy stays open: if it dies without sending, poll() sees EOF
            error = f"rendering took over {seconds} s"
            try:
                if recv.poll(seconds):
                    text, error = recv.recv()
            except EOFError:
                error = "the rendering process died"
            if error is None:
                out.append(dict(sample, prompt_text=text))
                continue
            child.kill()  # stuck, or at its memory cap: the next sample gets a new child
            child = None
            error = DataError(f"prompt template {where}: fails on sample {sample['id']}: {error}")
            if skipped is None:
                raise error
            skipped.append({"where": sample["id"], "error": str(error)})
    finally:
        for child in children:
            child.kill()
            child.join()
    return out


def chat_messages(sample: dict, text: str) -> list[dict]:
    """Chat messages with the media where the problem's <video>/<image> markers are, in order; media no marker
    claims (all of them when the text has no marker) go first. A marker beyond the sample's media is dropped."""
    unclaimed = {"video": len(sample.get("videos", [])), "image": len(sample.get("images", []))}
    content = []
    for part in re.split(r"(<video>|<image>)", text):
        kind = part[1:-1]
        if part in ("<video>", "<image>") and unclaimed[kind]:
            unclaimed[kind] -= 1
            content.append({"type": kind})
        elif part not in ("<video>", "<image>") and (part.strip() or part == text):
            content.append({"type": "text", "text": part})  # a text without markers: whole
    media = [{"type": kind} for kind, n in unclaimed.items() for _ in range(n)]
    return [{"role": "user", "content": media + content}]


@dataclass
class Prompt:
    """One sample made model-ready. Shared by the n rollouts of its group."""

    sample: dict  # the validated sample (id, answer, problem_type, options, ...)
    text: str  # chat-templated prompt, vision placeholders NOT expanded (for vLLM)
    prompt_ids: list[int]  # processor-expanded token ids (what the trainer feeds)
    # pixel_values(_videos) (SP: a run), *_grid_thw, second_per_grid_ts
    mm: dict = field(default_factory=dict)
    videos: list = field(default_factory=list)  # [(frames uint8 THWC, metadata dict)] for vLLM
    images: list = field(default_factory=list)  # [uint8 HWC] for vLLM
    audios: list = field(
        default_factory=list
    )  # [(waveform float32, rate)]: the videos' soundtracks
    omni: dict = field(
        default_factory=dict
    )  # the Omni processor's arguments (fps, use_audio_in_video)


def prepare(
    sample: dict,
    processor,
    media: Media,
    stats: dict | None = None,
    template: str | None = None,
    response_format: str = "answer",
    max_prompt_len: int = 0,
) -> Prompt:
    """Load media (cache or decode, by the `media` settings), render the chat prompt, run the processor once. A
    placeholder/feature mismatch or a prompt over max_prompt_len (0 = no limit; never truncated) is a DataError."""
    factor = cache.vision_factor(processor)
    sid = sample["id"]
    # the loaded tokenizer's own special tokens (load_samples refused Qwen-VL's before the model loaded)
    specials = [t.content for t in processor.tokenizer.added_tokens_decoder.values() if t.special]
    check_text(sample, f"sample {sid}", specials)
    end = sample.get("video_end")
    videos = [
        cache.load_video(path, media, factor, media.cache_dir, media.video_source, stats, end)
        for path in sample.get("videos", [])
    ]
    images = [cache.load_image(path, media, factor) for path in sample.get("images", [])]
    text = processor.apply_chat_template(
        chat_messages(sample, render_prompt(sample, template, response_format)),
        tokenize=False,
        add_generation_prompt=True,
    )
    omni = {}  # the Omni processor's own arguments, vLLM's too
    fps = {meta["sample_fps"] for _, meta in videos}
    if hasattr(processor, "feature_extractor") and fps:
        # the frames' rate, one number (its default, 2, is not ours): the Omni processor times the
        # frames against the soundtrack's 25 positions per second
        if len(fps) > 1:
            raise DataError(
                f"sample {sid}: the Omni processor takes one frame rate, its videos have {fps}"
            )
        omni["fps"] = fps.pop()
    audios = []
    sound = {}
    if media.video_audio:
        if not videos:
            # every micro-batch must run the audio tower: an idle one would hang FSDP2's other ranks
            raise DataError(
                f"sample {sid}: video_audio needs a video (a soundtrack) in every sample"
            )
        rate = processor.feature_extractor.sampling_rate
        window = processor.feature_extractor.n_samples / rate  # 30 s: longer is clipped
        audios = [  # over the frames' window: to video_end, or the frames' duration
            (cache.load_audio(path, media, rate, window, stats, meta["duration"]), rate)
            for path, (_, meta) in zip(sample["videos"], videos)
        ]
        omni["use_audio_in_video"] = True
        sound["audio"] = [a for a, _ in audios]
        # each padded to the 30 s window (Qwen2.5-Omni's processor does; Qwen3-Omni's pads a call's
        # clips to the longest): the rows' features stack in a batch
        sound["audio_kwargs"] = {"padding": "max_length"}
    ids, mm = run_processor(
        processor,
        text,
        videos=[torch.from_numpy(f).movedim(-1, -3) for f, _ in videos] or None,
        video_metadata=[hf_metadata(m) for _, m in videos] or None,
        images=[torch.from_numpy(im).movedim(-1, -3) for im in images] or None,
        **omni,
        **sound,
    )
    check_placeholders(ids, mm, processor, sid)
    if max_prompt_len and len(ids) > max_prompt_len:
        raise DataError(
            f"sample {sid}: prompt is {len(ids)} tokens > max_prompt_len={max_prompt_len} "
            "(lower the pixel/frame budget or raise max_prompt_len; prompts are never truncated)"
        )
    return Prompt(sample, text, ids, mm, videos, images, audios, omni)


def run_processor(processor, text: str, **media) -> tuple[list[int], dict]:
    """One prompt's token ids (vision placeholders expanded) and media tensors. The frames are already sampled and
    smart-resized (cache.py): the processor must not redo either."""
    out = processor(
        text=[text], return_tensors="pt", do_resize=False, do_sample_frames=False, **media
    )
    ids = out.pop("input_ids")[0].tolist()
    mm = {k: v for k, v in out.items() if k not in ("attention_mask", "mm_token_type_ids")}
    if "video_second_per_grid" in mm:  # Omni's name for it
        mm["second_per_grid_ts"] = mm.pop("video_second_per_grid")
    return ids, mm


def dummy_prompts(processor) -> dict:
    """{"image": Prompt, "video": Prompt}: the smallest input of each modality (zeros, one merged patch block; a video
    of one temporal patch). FSDP2 all-gathers the tower each time it runs (once per modality): sp.encode_vision runs
    the dummy of each modality a rank has no patch of, weight 0, so that every rank issues the same collectives."""
    f = cache.vision_factor(processor)
    meta = hf_metadata(cache.video_meta(2, 2.0, [0, 1], f, f))  # two frames at 2 fps
    media = {
        "image": dict(images=[torch.zeros(3, f, f, dtype=torch.uint8)]),
        "video": dict(videos=[torch.zeros(2, 3, f, f, dtype=torch.uint8)], video_metadata=[meta]),
    }
    out = {}
    for kind, kw in media.items():
        text = f"<|vision_start|>{getattr(processor, f'{kind}_token')}<|vision_end|>"
        ids, mm = run_processor(processor, text, **kw)
        out[kind] = Prompt({"id": f"dummy-{kind}", "problem_type": "dummy"}, text, ids, mm)
    return out


def grids(prompts: list, device) -> dict:
    """The rows' M-RoPE inputs, row by row: the media keys but the pixels (image/video_grid_thw, second_per_grid_ts;
    Omni: the soundtracks' input_features, feature_attention_mask, which its forward encodes)."""
    keys = sorted({k for p in prompts for k in p.mm if not k.startswith("pixel_values")})
    return {k: torch.cat([p.mm[k] for p in prompts if k in p.mm]).to(device) for k in keys}


def check_placeholders(ids: list[int], mm: dict, processor, sid: str):
    """Vision pad tokens in the prompt must equal the merged visual features, or the model's
    masked_scatter fails (or worse, misaligns). Caught here, before any compute is spent."""
    merge2 = processor.image_processor.merge_size**2
    tok = processor.tokenizer
    for kind in ("image", "video"):
        grid = f"{kind}_grid_thw"
        n_tok = ids.count(tok.convert_tokens_to_ids(getattr(processor, f"{kind}_token")))
        n_feat = int(mm[grid].prod(-1).sum()) // merge2 if grid in mm else 0
        if n_tok != n_feat:
            raise DataError(
                f"sample {sid}: {kind} placeholder tokens ({n_tok}) != {kind} features ({n_feat})"
            )


def hf_metadata(meta: dict) -> dict:
    """The frame metadata the HF video processor reads (Qwen3-VL: fps, frames_indices -> <t seconds> tokens): the
    cache's (cache.video_meta, which check_entry holds entries to) but sample_fps, ours."""
    return {k: v for k, v in meta.items() if k != "sample_fps"}


def vllm_input(p: Prompt, features: dict | None = None, timestamps: bool = False) -> dict:
    """vLLM's request: unexpanded text, the trainer's very frames, metadata saying not to sample frames again.
    features (modality -> this prompt's encoder output, its items one after another): the features instead of the
    pixels, with the grids (Qwen2.5-VL: second_per_grid_ts; timestamps, Qwen3-VL: each frame pair's time, which sizes
    its "<t seconds>" text), for an engine that loads no vision tower (enable_mm_embeds)."""
    if features is not None:
        return {"prompt": p.text, "multi_modal_data": embeds_input(p, features, timestamps)}
    media = {
        "video": [
            (frames, {**hf_metadata(meta), "do_sample_frames": False}) for frames, meta in p.videos
        ],
        "image": [Image.fromarray(im) for im in p.images],
    }
    kwargs = {"do_resize": False, "do_sample_frames": False, **p.omni}
    if p.audios:  # Omni: the soundtracks, each interleaved with its video's frames
        media["audio"] = p.audios
        # vLLM 0.32 chunks the interleaving by this argument alone (1 s by default), its positions by
        # the processor's output (qwen2_5_omni_thinker.py, get_replacement_qwen2_use_audio_in_video)
        kwargs["second_per_grid_ts"] = p.mm["second_per_grid_ts"].tolist()
    # vLLM takes one item bare, several as a list
    mm = {kind: items if len(items) > 1 else items[0] for kind, items in media.items() if items}
    return {"prompt": p.text, "multi_modal_data": mm, "mm_processor_kwargs": kwargs}


def embeds_input(p: Prompt, features: dict, timestamps: bool) -> dict:
    """vllm_input's multi_modal_data from features: per modality one dict of all its items (vLLM splits the
    features by the grids)."""
    mm = {
        kind: {f"{kind}_embeds": feats, f"{kind}_grid_thw": p.mm[f"{kind}_grid_thw"]}
        for kind, feats in features.items()
    }
    if "video" in mm and "second_per_grid_ts" in p.mm:
        mm["video"]["second_per_grid_ts"] = p.mm["second_per_grid_ts"]
    if "video" in mm and timestamps:
        mm["video"]["timestamps"] = [
            pair_times(meta, t) for (_, meta), t in zip(p.videos, p.mm["video_grid_thw"][:, 0])
        ]
    return mm


def pair_times(meta: dict, pairs: int) -> list[float]:
    """Qwen3-VL's time of each of a video's `pairs` temporal patches: the mean of its first and last frame's
    (vLLM's and transformers' rule; a last patch short of frames repeats the last frame)."""
    indices = list(meta["frames_indices"])
    size = -(-len(indices) // pairs)  # frames per temporal patch
    indices += indices[-1:] * (size * pairs - len(indices))
    seconds = [i / meta["fps"] for i in indices]
    return [(seconds[i] + seconds[i + size - 1]) / 2 for i in range(0, len(seconds), size)]


# The training stream, and bad samples met during training: reported and replaced, every rank in lockstep


@dataclass
class Stream:
    """Sample indices forever, a fresh permutation per epoch, the same on every rank; checkpoints hold the position."""

    n: int
    seed: int
    epoch: int = 0
    cursor: int = 0

    def take(self) -> int:
        # each epoch's order from the seed
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        index = torch.randperm(self.n, generator=g)[self.cursor].item()
        self.cursor += 1
        if self.cursor == self.n:
            self.epoch += 1
            self.cursor = 0
        return index


def try_prep(prep, s: dict, skip_invalid: bool):
    """(Prompt, None), or with skip_invalid (None, a skip report); without it a DataError naming the sample. Any
    exception (a processor's bare StopIteration...) is the sample's: a bug failing all hits max_consecutive_invalid"""
    try:
        return prep(s), None
    except Exception as e:
        error = DataError(f"sample {s['id']}: {type(e).__name__}: {e}")
        if not skip_invalid:
            raise error from e
        return None, {"where": s["id"], "media": media_paths(s), "error": str(error)}


PAD = object()  # a held-out sample's "pad" field: prepared only so that its rank generates, never scored (no JSON)


def held_out_rounds(prep, samples: list, skip_invalid: bool, layout, size: int, skips: list):
    """Held-out prompts, `size` at a time: this rank's TP group's share (Layout.share, what its engine generates),
    prepared by that group alone, one round's prompts held at a time; skip reports appended to `skips`. Every rank
    yields as many rounds (the HF engine's generate is collective): a group left without a prompt in a round (a
    shorter share, or the round's samples invalid) gets the first sample that prepares, marked PAD: never scored."""
    share = layout.share(samples, layout.tp).items
    rounds = max(gather(-(-len(share) // size)))
    pad = []  # prepared once, when first needed
    for first in range(0, rounds * size, size):
        results = [try_prep(prep, s, skip_invalid) for s in share[first : first + size]]
        prompts = [p for p, _ in results if p]  # the samples that prepare
        skips += [report for _, report in results if report]  # those that do not (skip_invalid)
        if not prompts and not pad:
            pad = first_valid([{**s, "pad": PAD} for s in samples], prep, skip_invalid)
        yield prompts or pad


def first_valid(samples: list, prep, skip_invalid: bool) -> list:
    """[the prompt of the first sample that prepares], or [] when none does."""
    for s in samples:
        prompt = try_prep(prep, s, skip_invalid)[0]
        if prompt:
            return [prompt]
    return []


def next_valid(
    stream: Stream, samples: list, prep, layout, count: int, skip_invalid: bool, max_invalid: int
) -> tuple[list, list]:
    """The next `count` samples' prompts (prepared by the TP group that generates them, else None) and skip reports.
    A failed slot is refilled from the stream; failures are gathered, so every rank refills the same slots and keeps
    the same stream position. Over max_invalid (max_consecutive_invalid) failures in a row are a DataError."""
    batch = [samples[stream.take()] for _ in range(count)]
    prompts = [None] * count
    skips = []
    todo = list(range(count))  # the slots still to fill
    run = 0  # invalid samples in a row
    while todo:
        reports = {}
        for i in filter(layout.prepares, todo):
            prompts[i], reports[i] = try_prep(prep, batch[i], skip_invalid)
        bad = {i: report for part in gather(reports) for i, report in part.items() if report}
        for i in todo:  # todo is in stream order
            run = run + 1 if i in bad else 0
            if run > max_invalid:
                raise DataError(
                    f"{run} invalid samples in a row (max_consecutive_invalid={max_invalid}): does the "
                    f"data set hold a valid sample? The last: {bad[i]['error']}"
                )
        todo = sorted(bad)
        for i in todo:
            skips.append(bad[i])
            batch[i] = samples[stream.take()]
    return prompts, skips

"""rollout.py: sample n completions per prompt, colocated in the training processes. Two engines
(VLLMEngine, HFEngine) with one interface, so the training loop never knows which one it has:

    engine.generate(prompts, n, temperature, max_tokens, seed) -> list[Rollout]  (n per prompt)
    engine.sync(model)     push the trainer's weights (FSDP2 shards gathered in dtype buckets, full
                           HF-named tensors)
    engine.sleep() / engine.wake()   free / restore the engine's GPU memory around the train phase

Both sample with the vision pad tokens masked out (a random model samples them, and a response
holding them cannot be fed back through the model) and report log-probs of that *processed*
distribution, softmax(logits / T) with those tokens at -inf, as the trainer computes it:
`logp_rollout - logp_trainer` measures only numerical mismatch.
"""

import contextlib
import gc
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist

from ckpt import hf_weights, published_layout
from common import UserError
from data import MEDIA_TOKENS, DataError, Prompt, grids, vllm_input
import sp


@dataclass
class Rollout:
    """One sampled (or offline) completion. Its group's n rollouts share `prompt`."""

    prompt: Prompt
    response_ids: list[int]  # sampled tokens, EOS included when the model stopped
    logp: list[float] | None  # sampler log-probs of response_ids; None for an offline trajectory
    text: str  # decoded completion (special tokens skipped), what rewards read
    finish: str = "stop"  # "stop" | "length" | "offline"


def request_seed(*parts) -> int:
    """A sampling seed from its parts, e.g. (cfg.seed, step, round), then (call seed, rank, prompt
    index): what a request samples does not depend on what ran before it, so a resumed run samples
    what the uninterrupted run did."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def failed(prompts: list, e: Exception) -> RuntimeError:
    """An engine failure (OOM, a crashed worker, bad input) names the samples it was generating."""
    return RuntimeError(
        f"rollout failed for samples {[p.sample['id'] for p in prompts]}: {type(e).__name__}: {e}"
    )


def device_normalize_ok(model_dir: str, trust_remote_code: bool = False) -> bool:
    """Whether vLLM may normalize pixels on the device (mm_device_do_normalize): vLLM 0.32
    normalizes videos with the image processor's mean/std, transformers with the video processor's;
    where they differ, vLLM must normalize on the CPU (docs/qwen3-vl-video-logprobs.md). Drop this
    when test_upstream_vllm_video_normalization fails."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    image = getattr(proc, "image_processor", None)
    video = getattr(proc, "video_processor", None)
    if image is None or video is None:
        return True
    for k in ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std"):
        # None (unset) becomes NaN, which never compares equal: an unknown setting keeps the safe
        # CPU path
        ours = np.asarray(getattr(image, k, None), float)
        theirs = np.asarray(getattr(video, k, None), float)
        if not np.array_equal(ours, theirs):
            return False
    return True


def eos_token_ids(model) -> list[int]:
    """The ids that end a response (generation_config holds one or a list)."""
    eos = model.generation_config.eos_token_id
    return eos if isinstance(eos, list) else [eos]


def vision_token_ids(tokenizer) -> list[int]:
    """The ids of MEDIA_TOKENS that the tokenizer knows: never sampled by either engine."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in MEDIA_TOKENS]
    return [i for i in ids if i is not None and i != tokenizer.unk_token_id]


# CPU: vLLM reserves gpu_memory_utilization of all RAM, refused where that much is not free (a
# shared machine); a 1 GiB KV cache instead (VLLM_CPU_KVCACHE_SPACE, GiB, overrides; CPU_KV_CACHE_MIB,
# MiB: scripts/rehearse.py's 8 ranks). Both engines, the trainer's and evaluate.py's
CPU_KV_CACHE_BYTES = int(os.environ.get("CPU_KV_CACHE_MIB", "1024")) * 2**20


# the published config.json values of the hub models (and the planner's measurements)
PUBLISHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs/memory.json")


def model_spec(model: str) -> dict | None:
    """The model's config.json, without weights or a network: a local folder's, a hub model's
    published values in configs/memory.json; None for any other."""
    local = os.path.join(model, "config.json")
    if os.path.isfile(local):
        with open(local) as f:
            return json.load(f)
    with open(PUBLISHED) as f:
        return json.load(f)["published"].get(model)


def linear_attention(spec: dict) -> bool:
    """Whether a model_spec has linear-attention layers (Qwen3.5's gated delta-net)."""
    return "linear_attention" in spec.get("text_config", spec).get("layer_types", [])


def engine_errors(model: str, tp: int, max_model_len: int) -> list[str]:
    """What vLLM refuses at engine start, found without weights or a network: its own ModelConfig and ParallelConfig
    checks on the model's config.json (model_spec; any other is checked when its engine starts): query heads vs
    tensor_parallel_size, max_model_len vs the model's positions (M-RoPE: long_overrides), and the split of the KV
    heads that its QKV layer makes at load (one of the KV heads and tensor_parallel_size divides the other)."""
    from vllm.config import ModelConfig, ParallelConfig

    spec = model_spec(model)
    local = os.path.isfile(os.path.join(model, "config.json"))
    if spec is None:
        return []
    overrides = long_overrides(spec.get("text_config", spec), max_model_len)
    with tempfile.TemporaryDirectory() as folder:
        if not local:
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(spec, f)
        try:
            config = ModelConfig(
                model=model if local else folder,
                max_model_len=max_model_len,
                skip_tokenizer_init=True,
                hf_overrides=overrides,
            )
            config.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=tp))
        except ValueError as e:  # pydantic's ValidationError is one
            text = " ".join(str(e).split()).split("Value error, ")[-1].split(" [type=")[0]
            first_two = ". ".join(text.split(". ")[:2])
            return [f"vLLM refuses {model} with rollout_tp {tp}: {first_two.rstrip('.')}"]
    kv = config.get_total_num_kv_heads()
    if kv % tp and tp % kv:
        return [
            f"vLLM refuses {model} with rollout_tp {tp}: its {kv} KV heads do not split over "
            f"{tp} ranks (QKVParallelLinear: one of them must divide the other)"
        ]
    return []


def long_overrides(text: dict, max_model_len: int) -> dict:
    """vLLM's hf_overrides for an M-RoPE model (Qwen-VL) given a max_model_len over its text config's
    max_position_embeddings. vLLM refuses that length (config/model.py, _get_and_verify_max_len):
    token positions past the RoPE cache (max_position_embeddings long) are out of range. Its
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lifts the check for every model. M-RoPE positions count a
    video's time steps, not its tokens (an hour of frames: ~256k tokens, ~7,200 time steps), so we
    raise the limit through the key vLLM itself reads for a longer context, the text config's
    model_max_length (model_arch_config_convertor's derived length, the check's override; no Qwen
    model reads it), the RoPE cache unchanged, and VLLMEngine refuses a prompt whose positions
    would leave it (check_positions). {} where the length fits, or the model is not M-RoPE."""
    rope = json.dumps(text.get("rope_parameters") or text.get("rope_scaling") or {})
    limit = text.get("max_position_embeddings", 0)
    if "mrope_section" not in rope or not 0 < limit < max_model_len:
        return {}
    return {"text_config": {"model_max_length": max_model_len}}


def vllm_settings(
    model_dir: str,
    *,
    tp: int,
    seed: int,
    dtype: str,
    max_model_len: int,
    gpu_memory_utilization: float,
    max_images: int,
    max_videos: int,
    trust_remote_code: bool,
) -> dict:
    """The engine arguments that the trainer's vLLM (VLLMEngine) and evaluate.py's AsyncLLM share:
    eager (no CUDA graphs) except on CUDA, the CPU's KV cache fixed (CPU_KV_CACHE_BYTES), pixels
    normalized on the device only where vLLM normalizes videos as transformers does
    (device_normalize_ok)."""
    from vllm.platforms import current_platform

    kv_cache_bytes = CPU_KV_CACHE_BYTES
    if current_platform.is_cuda():
        kv_cache_bytes = None  # sized by gpu_memory_utilization
    settings = dict(
        model=model_dir,
        tensor_parallel_size=tp,
        seed=seed,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=not current_platform.is_cuda(),
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_bytes,
        trust_remote_code=trust_remote_code,
        use_tqdm_on_load=False,
        limit_mm_per_prompt={"image": max_images, "video": max_videos},
        mm_device_do_normalize=device_normalize_ok(model_dir, trust_remote_code),
    )
    spec = model_spec(model_dir) or {}
    if "thinker_config" in spec:  # Omni: each video's soundtrack is an audio item
        settings["limit_mm_per_prompt"]["audio"] = max_videos
        # vLLM 0.32 processes the items its cache misses alone, and refuses a video whose
        # soundtrack hit (another video's, the same sound) (_get_hf_mm_inputs): no cache
        settings["mm_processor_cache_gb"] = 0
    if current_platform.is_cpu() and linear_attention(spec):
        # vLLM 0.32's CPU gated delta-net kernel (Qwen3.5's linear attention) is bf16-only, and
        # its prefix cache of hybrid models needs chunked prefill (off on the CPU: VLLMEngine)
        settings |= dict(dtype="bfloat16", enable_prefix_caching=False)
    return settings


@contextlib.contextmanager
def start_errors(max_model_len: int):
    """vLLM's start-up failures about memory as one line that names our knobs: its own message names
    gpu_memory_utilization, which on CPU does not size the KV cache (VLLM_CPU_KVCACHE_SPACE does, 1
    GiB here)."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        text = " ".join(str(e).split())
        if "memory" not in text.lower() and "Engine core initialization failed" not in text:
            raise
        from vllm.platforms import current_platform

        knob = f"VLLM_CPU_KVCACHE_SPACE (GiB, {CPU_KV_CACHE_BYTES // 2**30} by default)"
        if current_platform.is_cuda():
            knob = "--gpu-memory-utilization"
        raise UserError(
            f"vLLM did not start: {text[:400]} -> raise {knob} or lower --max-model-len "
            f"({max_model_len})"
        ) from None


def repack_cpu_experts(worker):
    """vLLM 0.32's reload of an unquantized MoE layer copies checkpoint-layout experts into the CPU
    kernel's prepacked storage and skips the prepack (unquantized_fused_moe_method.py
    _setup_kernel: `if not is_weight_update`); its own post-load step packs them again."""
    for layer in worker.model_runner.model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(layer)


class VLLMEngine:
    """vLLM built on EVERY rank with distributed_executor_backend="external_launcher" (a rank-0-only
    engine hangs). tp=1: one engine per rank, on its own prompts; tp > 1: one engine per tp
    consecutive ranks (all ranks, or one per part of an SP group), which pass the same prompts."""

    def __init__(
        self,
        model_dir: str,
        tokenizer,
        tp: int = 1,
        max_model_len: int = 4096,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        sleep: bool = True,
        seed: int = 0,
        max_images: int = 4,
        max_videos: int = 1,
        trust_remote_code: bool = False,
        encoder=None,
    ):
        # encoder (train.FrozenEncoder; prompts -> each one's features, modality -> tensor):
        # vLLM generates from the trainer's vision features, not pixels; it runs no vision tower,
        # and loads none (every limit_mm_per_prompt 0 with enable_mm_embeds: a missing layer)
        # except where it would drop features (Qwen3-VL's deepstack: below)
        # in-process: we must reach the model
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        self.tp = tp
        self.encoder = encoder
        embeds = encoder is not None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.external = dist.is_initialized()  # the process group is the trainer's, not vLLM's
        # sleep mode only exists on CUDA; on CPU vLLM refuses the flag outright
        self.can_sleep = sleep and current_platform.is_sleep_mode_available()
        backend = None  # vLLM's own
        if self.external:
            backend = "external_launcher"
        # Chunked prefill splits a prompt over two engine steps and rewinds the request's generator
        # for the token it discards; a CPU torch.Generator cannot rewind ("CPU Generator does not
        # use offset"). Off on CPU: a prompt that does not fit a step's token budget waits for the
        # next step, whole.
        chunk = not current_platform.is_cpu()
        # vLLM's start-up collects the whole heap 5 times (~1.7 CPU s here) and freezes it at the
        # end: freeze it now
        gc.freeze()
        with start_errors(max_model_len):
            settings = vllm_settings(
                model_dir,
                tp=tp,
                seed=seed + self.rank // tp,  # one stream per TP group
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                max_images=max_images,
                max_videos=max_videos,
                trust_remote_code=trust_remote_code,
            )
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            # vLLM 0.32 turns Qwen3-VL's deepstack off when the tower is a missing layer (qwen3_vl.py,
            # Qwen3VLForConditionalGeneration __init__: use_deepstack ... `not isinstance(self.visual,
            # StageMissingLayer)`), dropping the deepstack features it is given: kept, it never runs
            if embeds and not hasattr(config.vision_config, "deepstack_visual_indexes"):
                settings["limit_mm_per_prompt"] = {"image": 0, "video": 0}
            # past the model's positions: admitted for M-RoPE, each prompt checked (check_positions)
            overrides = long_overrides(config.get_text_config().to_dict(), max_model_len)
            self.llm = LLM(
                **settings,
                enable_sleep_mode=self.can_sleep,
                enable_chunked_prefill=chunk,
                max_num_batched_tokens=None if chunk else max(max_model_len, 4096),
                logprobs_mode="processed_logprobs",
                # tp > 1: each rank encodes whole videos with the whole tower, no all-reduce per
                # block (vLLM splits the weights where a model cannot); one video stays on one rank
                mm_encoder_tp_mode="data" if tp > 1 else "weights",
                distributed_executor_backend=backend,
                enable_mm_embeds=embeds,
                hf_overrides=overrides,
            )
        # long_overrides: the RoPE cache's length, which each prompt's positions must stay under
        self.config = self.llm.llm_engine.model_config.hf_config
        self.positions = 0
        if overrides:
            self.positions = self.config.get_text_config().max_position_embeddings
            if self.rank == 0:
                print(
                    f"vLLM: max_model_len {max_model_len} over the model's {self.positions} "
                    "positions, admitted: M-RoPE positions count time steps, not tokens, and "
                    "each prompt's are checked"
                )
        # Qwen3-VL's video features travel with each frame pair's time (its "<t seconds>" text), as
        # Qwen3-VL-MoE's and Qwen3.5's (the same processor)
        self.timestamps = self.config.model_type.startswith(("qwen3_vl", "qwen3_5"))
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        banned = set(vision_token_ids(tokenizer))
        self.allowed = [i for i in range(vocab) if i not in banned]
        # what sleep() released and no wake() has restored yet: "weights", "kv_cache"
        self.asleep = set()

    def generate(
        self, prompts: list[Prompt], n: int, temperature: float, max_tokens: int, seed: int
    ) -> list[Rollout]:
        from vllm import SamplingParams

        self.wake()
        # a TP group generates together: its ranks must pass identical requests, seeds included
        sp = [
            SamplingParams(
                n=n,
                temperature=temperature,
                max_tokens=max_tokens,
                logprobs=0,
                skip_special_tokens=True,
                allowed_token_ids=self.allowed,
                seed=request_seed(seed, self.rank // self.tp, i),
            )
            for i in range(len(prompts))
        ]
        for p in prompts:
            self.check_positions(p, max_tokens)
        inputs = [vllm_input(p) for p in prompts]
        if self.encoder is not None:  # every rank of an FSDP run calls it as often (collective)
            features = self.encoder(prompts)
            inputs = [vllm_input(p, f, self.timestamps) for p, f in zip(prompts, features)]
        try:
            outs = self.llm.generate(inputs, sp, use_tqdm=False)
        except Exception as e:  # re-raised with the sample ids, never swallowed
            raise failed(prompts, e) from e
        rollouts = []
        for p, out in zip(prompts, outs):
            # vLLM expanded the placeholders itself: it must have built exactly the trainer's prompt
            if list(out.prompt_token_ids) != p.prompt_ids:
                raise RuntimeError(
                    f"sample {p.sample['id']}: vLLM prompt ({len(out.prompt_token_ids)} tokens) "
                    f"differs from the processor's ({len(p.prompt_ids)}): frames/metadata disagree"
                )
            for c in out.outputs:
                ids = list(c.token_ids)
                logp = None  # greedy: no log-probs
                if temperature > 0:
                    logp = [d[t].logprob for t, d in zip(ids, c.logprobs)]
                finish = "length" if c.finish_reason == "length" else "stop"
                rollouts.append(Rollout(p, ids, logp, c.text, finish))
        return rollouts

    def check_positions(self, p: Prompt, max_tokens: int):
        """long_overrides' condition, per prompt: its M-RoPE positions and max_tokens more stay
        inside the model's RoPE cache (a sparse sample of a long video can pass it: time steps
        scaled by seconds, each of few tokens)."""
        if not self.positions:
            return
        ids = torch.tensor([p.prompt_ids])
        last = int(
            sp.mrope_positions(ids, torch.ones_like(ids), grids([p], "cpu"), self.config).max()
        )
        if last + max_tokens >= self.positions:
            raise DataError(
                f"sample {p.sample['id']}: its M-RoPE positions reach {last}, + max_response_len "
                f"{max_tokens}: past the model's {self.positions} positions (fewer frames or a "
                "shorter response)"
            )

    @torch.no_grad()
    def sync(self, model):
        """Stream the trainer's full HF-named tensors (hf_weights) into vLLM with vLLM 0.32's
        `reload_weights` worker RPC (in place on CPU and GPU; model.load_weights fails on CPU; the
        in-process executor consumes the stream lazily, a bucket at a time), then drop every cache
        derived from the old weights."""
        from vllm.platforms import current_platform

        # the weights only: they are overwritten before the KV cache is needed
        self.wake(tags=["weights"])
        weights = published_layout(hf_weights(model), self.config.model_type)
        if self.encoder is not None:  # the trainer's tower is frozen: vLLM has its weights or none
            # the vision tower's tensors left out (still gathered: a collective)
            weights = ((name, w) for name, w in weights if ".visual." not in f".{name}")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if current_platform.is_cpu():
            self.llm.collective_rpc(repack_cpu_experts)
        # stale vision embeddings would otherwise be served ("Encoder cache miss" at best)
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()
        self.llm.reset_mm_cache()

    def close(self):
        """Shut vLLM down now (at exit __del__ prints a traceback), but not the trainer's default
        group, which vLLM's shutdown destroys: made again on torchrun's store, a next run's groups
        meet stale keys (its engine hangs)."""
        from vllm.distributed import parallel_state

        keep = contextlib.nullcontext()
        if self.external:
            keep = mock.patch.object(
                parallel_state, "destroy_distributed_environment", lambda: None
            )
        with keep:
            self.llm.llm_engine.engine_core.shutdown()

    def sleep(self):
        """Free the GPU memory of the weights and the KV cache for the train phase (CUDA only)."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=1)  # level 1: weights to CPU RAM, KV cache dropped
            self.asleep = {"weights", "kv_cache"}

    def wake(self, tags=None):
        """Restore what sleep() released (tags=None: all of it), never a part twice."""
        todo = sorted(self.asleep if tags is None else self.asleep & set(tags))
        if self.can_sleep and todo:
            self.llm.wake_up(tags=todo)
            self.asleep -= set(todo)


class HFEngine:
    """Sampling with transformers' generate on the (possibly FSDP2-sharded) training model itself,
    all of a call's rows in one batch (synced_gpus keeps the ranks in lockstep); for machines
    without vLLM, and a reference in tests."""

    def __init__(self, model, tokenizer, eos_ids: list[int], dummies: dict | None = None):
        # dummies (data.dummy_prompts, multi-rank FSDP only): as in the trainer, a modality the
        # prompts lack runs its dummy through the vision tower, so all ranks run the tower the same
        # number of times
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.dummies = dummies
        self.banned = vision_token_ids(tokenizer)
        self.encoder = None  # the model encodes the pixels (VLLMEngine's: the trainer's features)

    def config(self, temperature: float, max_tokens: int):
        """transformers' generation settings: as vLLM samples (no top-p/top-k), greedy at
        temperature 0."""
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=temperature > 0,
            temperature=temperature or None,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            suppress_tokens=self.banned,
            output_logits=True,
            return_dict_in_generate=True,
        )

    @torch.no_grad()
    def generate(
        self, prompts: list[Prompt], n: int, temperature: float, max_tokens: int, seed: int
    ) -> list[Rollout]:
        if hasattr(self.model, "unshard"):
            # generate() runs the vision encoder outside the root module's forward, so FSDP2's root
            # hook never gathers the root-held parameters (patch embedding, merger): gather them by
            # hand. The root must be initialized first, or a child block claims to be the root
            # (torch 2.14 private API)
            self.model._get_fsdp_state()._lazy_init()
            self.model.unshard()
        try:
            return self._generate(prompts, n, temperature, max_tokens, seed)
        except Exception as e:  # re-raised with the sample ids, never swallowed
            raise failed(prompts, e) from e
        finally:
            if hasattr(self.model, "reshard"):
                self.model.reshard()

    def _generate(self, prompts, n, temperature, max_tokens, seed) -> list[Rollout]:
        """All prompts x n rows in ONE left-padded generate call; one seed per (call, rank): rows of
        a batch share the global RNG stream, so what a row samples depends on the batch, not on
        earlier calls."""
        device = next(self.model.parameters()).device
        rank = dist.get_rank() if dist.is_initialized() else 0
        # FSDP: every rank must run every step
        synced = dist.is_initialized() and dist.get_world_size() > 1
        torch.manual_seed(request_seed(seed, rank))
        rows = [p for p in prompts for _ in range(n)]
        P = max(len(r.prompt_ids) for r in rows)
        pad = [P - len(r.prompt_ids) for r in rows]
        ids = torch.tensor(
            [[self.tokenizer.pad_token_id] * k + r.prompt_ids for k, r in zip(pad, rows)],
            device=device,
        )
        attn = torch.tensor(
            [[0] * k + [1] * len(r.prompt_ids) for k, r in zip(pad, rows)], device=device
        )
        # the vision tower runs once per distinct prompt (a group's n rows share one Prompt), not
        # once per row: generate gets the features laid out per row for the prefill, and the
        # trainer's M-RoPE positions (sp.mrope_positions), which it continues from the last one + 1
        # per new token (vLLM: from the largest + 1, the same position)
        features = sp.encode_vision(self.model, rows, device, dummies=self.dummies)
        whole = sp.Shard(None, ids.shape[1], 0, ids.shape[1])  # one rank holds the whole sequence
        vision = sp.shard_features(self.model, features, ids, rows, whole)
        rows_grids = grids(rows, device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attn,
            mm_encoder_outputs=vision,
            synced_gpus=synced,
            position_ids=sp.mrope_positions(ids, attn, rows_grids, self.model.config),
            generation_config=self.config(temperature, max_tokens),
            **sp.audio_inputs(rows_grids),
        )
        seq = out.sequences[:, P:]  # (B, R)
        logp = torch.zeros(seq.shape)
        for t, logits in enumerate(out.logits):  # R steps of (B, V): no stacked (B, R, V) copy
            logits = logits.float()
            logits[:, self.banned] = float("-inf")
            logprobs = torch.log_softmax(logits / (temperature or 1.0), -1)  # (B, V)
            logp[:, t] = logprobs.gather(-1, seq[:, t : t + 1])[:, 0].cpu()
        rollouts = []
        for p, row, lp in zip(rows, seq.tolist(), logp.tolist()):
            # up to the first EOS, included (generate pads the rows that stopped)
            ends = [i + 1 for i, t in enumerate(row) if t in self.eos_ids]
            k = len(row)
            finish = "length"
            if ends:
                k = ends[0]
                finish = "stop"
            text = self.tokenizer.decode(row[:k], skip_special_tokens=True)
            logp_row = None  # greedy: no log-probs
            if temperature > 0:
                logp_row = lp[:k]
            rollouts.append(Rollout(p, row[:k], logp_row, text, finish))
        return rollouts

    def sync(self, *args, **kwargs):
        """Nothing to push, free or restore: it samples from the training model itself."""

    sleep = wake = close = sync

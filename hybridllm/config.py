"""Frozen engine configuration, validated once at construction (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridllm import envs
from hybridllm.plan.cpu_dtype import cpu_kv_cache_dtype
from hybridllm.plan.plan import Plan

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# auto: float16 on CPU workers that compute fp32 from GGUF blocks with int8 activations, else the
# compute dtype; float16/bfloat16 under float32 compute: CPU workers store keys and values in 16
# bits (half the bytes a decode step reads); GPU workers keep the compute dtype
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SUPPORTED_DEVICES = ("auto", "cpu", "cuda", "heterogeneous")
SUPPORTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# auto: GGUF blocks kept on CPU workers; none: every weight dequantized; q8_0/q4_0/q4_1: as
# auto, and CPU workers quantize float linears into that type at load (loader/onload_quant.py)
SUPPORTED_QUANTIZATION = ("auto", "none", "q8_0", "q4_0", "q4_1")
# int8: GGUF linears on CPU workers quantize their activations for integer dot products
# (approximate, faster decode); fp32: exact up to fp32 rounding
SUPPORTED_GGUF_ACTIVATIONS = ("int8", "fp32")


@dataclass(frozen=True)
class ModelConfig:
    """The model to run: where it lives, its HF config, and the compute dtype."""

    model: str  # path to an HF folder or a .gguf file
    hf_config: Any  # loader.hf_config.HFConfig (read-only), or any object with its fields
    dtype: str  # resolved: "float32" | "bfloat16" | "float16"
    max_model_len: int
    architecture: str
    tokenizer: str | None = None  # path; defaults to the model's own tokenizer
    # No tokenizer at all: prompts are token ids, outputs carry token ids and empty text
    # (no detokenization, no stop strings); `tokenizer` is then not loaded.
    skip_tokenizer_init: bool = False
    eos_token_ids: tuple[int, ...] = ()  # generation config's end-of-sequence ids, primary first
    # auto: CPU workers compute GGUF linears of the types in loader/block_sizes.py's
    # GGUF_KERNEL_TYPES (loader/gguf_kernel_types.py) from their blocks;
    # none: every weight is dequantized to `dtype` at load time; q8_0/q4_0/q4_1: as auto, and
    # CPU workers quantize float linears into that type at load
    quantization: str = "auto"
    cpu_blocks: Any = None  # plan.model_size.GGUFBlockSizes when CPU workers keep GGUF blocks

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget the number of blocks comes from."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU budget; None: a fraction of free RAM
    max_gpu_memory_bytes: int | None = None  # per GPU worker: weights + activations + KV
    max_cpu_memory_bytes: int | None = None  # all CPU workers: weights + KV
    num_gpu_blocks_override: int | None = None  # tests: force a tiny pool (preemption)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # CPU workers' cache dtype (SUPPORTED_KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {SUPPORTED_KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_blocks override must be >= 1, got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step; chunked prefill splits prompts larger than what is left."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class DeviceConfig:
    """Where the single worker runs (the heterogeneous plan generalises this)."""

    device: str = "cpu"  # resolved: "cpu" | "cuda"
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be resolved to 'cpu' or 'cuda', got {self.device!r}")


@dataclass(frozen=True)
class KernelConfig:
    """What CPU workers compute with; each setting changes results or memory, and defaults to its
    environment variable (hybridllm/envs.py)."""

    cpu_kernels: bool = True  # the native CPU kernels; off: the torch paths, GGUF dequantized
    gguf_activations: str = "int8"  # SUPPORTED_GGUF_ACTIVATIONS
    native_decode_layer: bool = True  # a whole decoder layer in one native call where it can

    def __post_init__(self) -> None:
        if self.gguf_activations not in SUPPORTED_GGUF_ACTIVATIONS:
            raise ValueError(
                f"gguf_activations must be one of {SUPPORTED_GGUF_ACTIVATIONS}, "
                f"got {self.gguf_activations!r}"
            )
        for name in ("cpu_kernels", "native_decode_layer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def int8_over_blocks(self, cpu_blocks: object | None) -> bool:
        """Whether CPU workers compute int8 activations over GGUF blocks: they keep some
        (`cpu_blocks`, what the loader counts; None: every weight float, since blocks are kept
        only where the kernels are built) and the activations are int8."""
        return cpu_blocks is not None and self.gguf_activations == "int8"

    @classmethod
    def from_env(
        cls,
        cpu_kernels: bool | None = None,
        gguf_activations: str | None = None,
        native_decode_layer: bool | None = None,
    ) -> KernelConfig:
        """The settings given; the environment's (or their defaults) for those left None. A bad
        environment value is a ValueError naming the variable."""
        return cls(
            cpu_kernels=envs.read(envs.CPU_KERNELS) if cpu_kernels is None else cpu_kernels,
            gguf_activations=(
                envs.read(envs.GGUF_ACTIVATIONS) if gguf_activations is None else gguf_activations
            ),
            native_decode_layer=(
                envs.read(envs.NATIVE_DECODE_LAYER)
                if native_decode_layer is None
                else native_decode_layer
            ),
        )


SUPPORTED_SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# chained MTP drafts each cost a forward of the MTP layer and guess worse the further they go
MAX_MTP_DRAFTS = 8
# keys of `speculative_config`, as vLLM names them
_SPECULATIVE_KEYS = (
    "method",
    "model",
    "quantization",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decode step also verifies up to `num_speculative_tokens`
    drafted tokens, so one pass over the weights may yield several tokens (spec_decode/)."""

    # "ngram"; "draft_model": a small model with the same vocabulary drafts; "mtp": the
    # checkpoint's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5) drafts, chained on
    # its own output past the first draft
    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None  # draft_model: the draft's checkpoint (a GGUF file or HF folder)
    quantization: str | None = None  # draft_model: the draft's --quantization (None: auto)
    prompt_lookup_max: int = 4  # n-gram: longest suffix looked up in the request's tokens
    prompt_lookup_min: int = 2  # n-gram: shortest
    # no drafts in a step where this many requests or more run (None: any batch); a large
    # batch is compute-bound, where a rejected draft costs as much as a kept token
    disable_by_batch_size: int | None = 8
    # draft_model: the draft's resolved engine config (EngineArgs sets it; one CPU worker)
    draft_config: EngineConfig | None = None

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {SUPPORTED_SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        if (self.method == "draft_model") != isinstance(self.model, str):
            raise ValueError(
                "speculative_config 'model' (a path) goes with method 'draft_model' and only "
                f"with it; got method {self.method!r} and model {self.model!r}"
            )
        if self.quantization is not None and (
            self.method != "draft_model" or self.quantization not in SUPPORTED_QUANTIZATION
        ):
            raise ValueError(
                f"speculative_config quantization must be one of {SUPPORTED_QUANTIZATION} and "
                f"goes with a draft 'model'; got {self.quantization!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(
                    f"speculative_config {name} must be an integer in [1, 64], got {value!r}"
                )
        if self.method == "mtp" and self.num_speculative_tokens > MAX_MTP_DRAFTS:
            raise ValueError(
                "speculative_config method 'mtp' chains the checkpoint's MTP layer on its own "
                f"output for drafts past the first; num_speculative_tokens must be at most "
                f"{MAX_MTP_DRAFTS}, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ):
            raise ValueError(
                f"speculative_config disable_by_batch_size must be an integer >= 1 or null, "
                f"got {limit!r}"
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's `speculative_config` dict -> a validated config; a ValueError names any key
        that is unknown, of the wrong type, or asks for a method not built yet."""
        if not isinstance(config, dict):
            raise ValueError(
                f"speculative_config must be a JSON object, got {type(config).__name__}"
            )
        unknown = sorted(str(k) for k in config if k not in _SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {list(_SPECULATIVE_KEYS)}"
            )
        values = dict(config)
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs num_speculative_tokens")
        # as vLLM: a draft model given without a method means method "draft_model"
        values.setdefault("method", "draft_model" if "model" in values else "ngram")
        # as vLLM: one of the two lookup bounds given sets the other
        given_max, given_min = values.get("prompt_lookup_max"), values.get("prompt_lookup_min")
        if isinstance(given_max, int) and given_min is None:
            values["prompt_lookup_min"] = min(given_max, cls.prompt_lookup_min)
        if isinstance(given_min, int) and given_max is None:
            values["prompt_lookup_max"] = max(given_min, cls.prompt_lookup_max)
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    seed: int = 0
    plan: Plan | None = None  # None: everything on one worker on device_config.device
    # "uni": workers in the engine process; "mp": a process each; "ray": a Ray actor each
    distributed_executor_backend: str = "uni"
    ray_address: str | None = None  # the Ray cluster to join (None: RAY_ADDRESS, else local)
    # Not positional: built without one, a config takes the environment's settings.
    kernel_config: KernelConfig = field(default_factory=KernelConfig.from_env)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        num_layers = self.model_config.num_layers
        if self.plan is None:
            # frozen: the one place a field is filled in, before anyone can read it
            object.__setattr__(self, "plan", Plan.single(self.device_config.device, num_layers))
        if self.plan.num_layers != num_layers:
            raise ValueError(
                f"the plan covers {self.plan.num_layers} layers; the model has {num_layers}"
            )
        backend = self.distributed_executor_backend
        if backend not in SUPPORTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {SUPPORTED_EXECUTOR_BACKENDS}, "
                f"got {backend!r}"
            )
        if self.ray_address is not None and backend != "ray":
            raise ValueError(
                f"ray_address is for distributed_executor_backend='ray', not {backend!r}"
            )
        if backend != "ray" and any(s.node is not None for s in self.plan.stages):
            raise ValueError(
                "the plan places stages on cluster nodes: it needs distributed_executor_backend="
                f"'ray', not {backend!r}"
            )
        if backend == "uni" and self.plan.tensor_parallel_size > 1:
            raise ValueError(
                "tensor parallelism needs one process per rank: use "
                "distributed_executor_backend='mp' (the 'uni' executor runs every worker "
                "in the engine process)"
            )

    @property
    def cpu_kv_cache_dtype(self) -> str:
        """What CPU workers' KV caches hold (plan/cpu_dtype.py): float16 under "auto" where they
        compute float32 from GGUF blocks with int8 activations, else the compute dtype."""
        mc = self.model_config
        int8_blocks = self.kernel_config.int8_over_blocks(mc.cpu_blocks)
        return cpu_kv_cache_dtype(self.cache_config.kv_cache_dtype, mc.dtype, int8_blocks)

    def describe_kernels(self) -> str:
        """The kernel settings and the CPU KV cache dtype they imply, for the log line."""
        k = self.kernel_config
        on = {True: "on", False: "off"}
        return (
            f"cpu kernels {on[k.cpu_kernels]}, GGUF activations {k.gguf_activations}, "
            f"native decode layer {on[k.native_decode_layer]}, "
            f"CPU KV cache {self.cpu_kv_cache_dtype}"
        )

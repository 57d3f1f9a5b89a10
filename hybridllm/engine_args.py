"""User-facing engine arguments (CLI flags and `LLM(...)` keywords) and their resolution into `EngineConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridllm.config import (
    SUPPORTED_DEVICES,
    SUPPORTED_DTYPES,
    SUPPORTED_KV_CACHE_DTYPES,
    SUPPORTED_QUANTIZATION,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KernelConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from hybridllm.engine.kv_cache_groups import kv_cache_groups
from hybridllm.plan.placement_args import PlacementArgs, parse_memory_size
from hybridllm.plan.plan import Plan

if TYPE_CHECKING:
    from hybridllm.loader.model_source import ModelSource
    from hybridllm.plan.model_size import GGUFBlockSizes

logger = logging.getLogger(__name__)


@dataclass
class EngineArgs:
    """Everything a user can set; `create_engine_config` validates and resolves it once."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None
    # Load no tokenizer: prompts must be token ids, outputs have token ids and text "".
    # Python API only (not a CLI flag): the server and the CLI commands take and give text.
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    quantization: str = "auto"  # auto: GGUF linears computed from their blocks on CPU workers
    device: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: str | int | None = None  # CPU KV budget, e.g. "2GiB"
    # CPU workers' KV cache: auto = float16 where they compute fp32 from GGUF blocks with int8
    # activations, else the compute dtype; float16/bfloat16 under fp32 compute
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    num_gpu_blocks_override: int | None = None
    cpu_threads: int | None = None
    seed: int = 0
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "uni" for one worker, else "mp"
    ray_address: str | None = None  # ray: the cluster to join (default: RAY_ADDRESS, else local)
    # layers per pipeline stage, e.g. "10,20" or (10, 20)
    layer_split: str | list[int] | tuple[int, ...] | None = None
    # like llama.cpp -ngl: the last N layers, the final norm and the LM head on the GPU
    gpu_layers: int | None = None
    max_gpu_memory: str | int | None = None  # per GPU, e.g. "8GiB" or bytes
    max_cpu_memory: str | int | None = None  # all CPU workers together
    # CPU stages beside a GPU compute steps of at least this many tokens on it by streaming
    # their weights: None = the cost model's crossover, -1 = never, 0 = always
    stream_threshold: int | None = None
    stream_device: str | None = None  # None: the plan's GPU; "cpu" checks the path without one
    # MoE: routed experts of every layer (cpu_moe) or of the first N layers on the CPU
    cpu_moe: bool = False
    n_cpu_moe: int | None = None
    # What CPU workers compute with (config.KernelConfig); None: the environment variable's value
    # (HYBRIDLLM_CPU_KERNELS, HYBRIDLLM_GGUF_ACTIVATIONS, HYBRIDLLM_NATIVE_DECODE_LAYER)
    cpu_kernels: bool | None = None
    gguf_activations: str | None = None  # "int8" | "fp32"
    native_decode_layer: bool | None = None
    # vLLM's speculative_config, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    speculative_config: dict[str, Any] | None = None

    def create_engine_config(self) -> EngineConfig:
        # Deferred imports: the loader and torch are heavy and not needed to parse flags.
        import torch

        from hybridllm.loader import default_model_path, open_model_source

        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.quantization not in SUPPORTED_QUANTIZATION:
            raise ValueError(
                f"quantization must be one of {SUPPORTED_QUANTIZATION}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {SUPPORTED_KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.device not in SUPPORTED_DEVICES:
            raise ValueError(f"device must be one of {SUPPORTED_DEVICES}, got {self.device!r}")
        kernel_config = self.kernel_config()
        ray = self.distributed_executor_backend == "ray"  # the GPUs may be on other nodes
        if self.device == "cuda" and not ray and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but no CUDA GPU is available")

        model_path = self.model or default_model_path()
        source = open_model_source(model_path)
        hf_config = source.hf_config
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{model_path}: config has no 'architectures' entry")
        from hybridllm.models.registry import get_model_class

        model_class = get_model_class(archs[0])  # fails early, naming the architecture
        if self.tensor_parallel_size > 1 and not getattr(
            model_class, "supports_tensor_parallel", True
        ):
            from hybridllm.models.moe import tensor_parallel_error

            raise ValueError(tensor_parallel_error(archs[0]))

        max_model_len = self.resolve_max_model_len(hf_config)
        batched = self.resolve_max_num_batched_tokens(max_model_len)
        speculative_config = self.resolve_speculative_config(hf_config, max_model_len, batched)
        quantization = self.resolve_quantization(source)
        cpu_blocks = self.kept_cpu_blocks(source, hf_config, kernel_config)
        cpu_auto = self._cpu_auto_dtype(hf_config, cpu_blocks, quantization)
        int8_blocks = kernel_config.int8_over_blocks(cpu_blocks)
        plan = self._build_plan(
            hf_config, batched, max_model_len, cpu_blocks, cpu_auto, int8_blocks, speculative_config
        )
        device = "cuda" if any(not w.is_cpu for w in plan.workers()) else "cpu"
        dtype = _resolve_dtype(self.dtype, device, cpu_auto)
        _check_kv_cache_dtype(self.kv_cache_dtype, dtype)
        model_config = ModelConfig(
            model=model_path,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            architecture=archs[0],
            tokenizer=self.tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
            eos_token_ids=_eos_token_ids(source.generation_config, hf_config),
            quantization=quantization,
            cpu_blocks=cpu_blocks,
        )
        kv_bytes = _optional_size(self.kv_cache_memory)
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
            max_gpu_memory_bytes=_optional_size(self.max_gpu_memory),
            max_cpu_memory_bytes=_optional_size(self.max_cpu_memory),
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=batched,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        device_config = DeviceConfig(device=device, cpu_threads=self.cpu_threads)
        backend = self.distributed_executor_backend or ("uni" if plan.world_size == 1 else "mp")
        config = EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            device_config,
            self.seed,
            plan=plan,
            distributed_executor_backend=backend,
            ray_address=self.ray_address,
            kernel_config=kernel_config,
            speculative_config=speculative_config,
        )
        logger.info(
            "engine config: %s (%s) on %s, %d worker(s); %s",
            model_path,
            dtype,
            device,
            plan.world_size,
            config.describe_kernels(),
        )
        return config

    def resolve_speculative_config(
        self, hf_config, max_model_len: int = 0, max_num_batched_tokens: int = 0
    ) -> SpeculativeConfig | None:
        """The validated speculative config, or None; refused for a model whose layers keep a
        recurrent state, which a rejected draft would leave advanced past the kept tokens. A
        draft model is resolved here too: its own engine config, one CPU worker."""
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(self.speculative_config)
        if _keeps_recurrent_state(hf_config):
            raise ValueError(
                "speculative decoding is not supported for models with linear-attention layers: "
                "their recurrent state cannot take back a rejected draft"
            )
        if config.method == "mtp":
            self.check_mtp(hf_config)
        if config.method != "draft_model":
            return config
        draft = self.draft_engine_config(config, max_model_len, max_num_batched_tokens)
        draft_vocab = draft.model_config.vocab_size
        if draft_vocab != hf_config.vocab_size:
            logger.warning(
                "the draft model's vocabulary (%d) differs from the model's (%d): drafts are "
                "taken from the first %d token ids",
                draft_vocab,
                hf_config.vocab_size,
                min(draft_vocab, hf_config.vocab_size),
            )
        return dataclasses.replace(config, draft_config=draft)

    def check_mtp(self, hf_config) -> None:
        """Method 'mtp' needs an architecture with an MTP layer and a checkpoint that carries
        one (an HF folder, or a GGUF file whose converter kept it, as GLM-4.5's does)."""
        from hybridllm.models.mtp import num_mtp_layers
        from hybridllm.models.registry import get_model_class

        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        if not getattr(get_model_class(arch), "supports_mtp", False):
            raise ValueError(
                f"speculative_config method 'mtp': {arch} has no multi-token-prediction layer "
                "hybridllm runs (DeepSeek-V2/V3, Kimi-K2, GLM-4.5 and GLM-4.7-Flash do)"
            )
        if num_mtp_layers(hf_config) < 1:
            where = (
                "the GGUF file's nextn_predict_layers is 0: its converter dropped the MTP layer"
                if str(self.model or "").endswith(".gguf")
                else "the config's num_nextn_predict_layers is 0, so the checkpoint carries none"
            )
            raise ValueError(
                f"speculative_config method 'mtp': {where}; use 'ngram' or a draft 'model'"
            )

    def draft_engine_config(
        self, config: SpeculativeConfig, max_model_len: int, max_num_batched_tokens: int
    ) -> EngineConfig:
        """The draft model's engine config: this engine's context, step budget, threads and
        kernels, on one CPU worker, without a tokenizer (it sees token ids only)."""
        draft_args = EngineArgs(
            model=config.model,
            skip_tokenizer_init=True,
            quantization=config.quantization or "auto",
            device="cpu",
            max_model_len=max_model_len,
            block_size=self.block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            cpu_threads=self.cpu_threads,
            seed=self.seed,
            cpu_kernels=self.cpu_kernels,
            gguf_activations=self.gguf_activations,
            native_decode_layer=self.native_decode_layer,
        )
        try:
            draft = draft_args.create_engine_config()
        except (ValueError, OSError) as exc:
            raise ValueError(f"speculative_config model {config.model!r}: {exc}") from exc
        if _keeps_recurrent_state(draft.model_config.hf_config):
            raise ValueError(
                f"speculative_config model {config.model!r}: a draft with linear-attention "
                "layers is not supported (its recurrent state cannot take back a rejected draft)"
            )
        return draft

    def resolve_max_model_len(self, hf_config) -> int:
        """The context length: `max_model_len`, else the model's; never beyond the model's."""
        model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = self.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's context ({model_max})"
            )
        return max_model_len

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        """One step's token budget: without chunked prefill a whole prompt must fit it."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)

    def placement_args(
        self,
        max_model_len: int,
        max_num_batched_tokens: int,
        cpu_auto_dtype: str = "float32",
        int8_blocks: bool = False,
        speculative_config: SpeculativeConfig | None = None,
    ) -> PlacementArgs:
        """What the planner is asked (the engine and `hybridllm plan` alike): the flags, and the
        KV cache to reserve beside the weights, `max_num_seqs` sequences of a typical 256 tokens
        up to one full context; a resolved `speculative_config`'s draft model is taken from the
        host budget."""
        from hybridllm.plan.draft_memory import draft_memory
        from hybridllm.plan.memory_budget import format_bytes

        split = parse_layer_split(self.layer_split)
        draft = (
            None
            if speculative_config is None
            else draft_memory(speculative_config, self.max_num_seqs)
        )
        return PlacementArgs(
            device=self.device,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            gpu_layers=self.gpu_layers,
            max_gpu_memory=_optional_size(self.max_gpu_memory),
            max_cpu_memory=_optional_size(self.max_cpu_memory),
            gpu_memory_utilization=self.gpu_memory_utilization,
            layer_split=None if split is None else tuple(split),
            cpu_threads=self.cpu_threads,
            kv_reserve_tokens=min(max_model_len, self.max_num_seqs * 256),
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            dtype=self.dtype,
            cpu_auto_dtype=cpu_auto_dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            int8_blocks=int8_blocks,
            stream_threshold=self.stream_threshold,
            stream_device=self.stream_device,
            cpu_moe=self.cpu_moe,
            n_cpu_moe=self.n_cpu_moe,
            mtp=isinstance(self.speculative_config, dict)
            and self.speculative_config.get("method") == "mtp",
            host_reserved_bytes=0 if draft is None else draft.total_bytes,
            host_reserved_note=""
            if draft is None
            else f"the draft model {draft.model} (weights {format_bytes(draft.weight_bytes)}, "
            f"KV cache {format_bytes(draft.kv_cache_bytes)}) in the engine's process",
        )

    def resolve_quantization(self, source: ModelSource) -> str:
        """What `quantization` means for this checkpoint: as given, except that "auto" on a
        block-scaled FP8 folder is q8_0 (loader/fp8_block.py); says in the log what an FP8
        folder's CPU workers re-block its weights into."""
        from hybridllm.loader.fp8_block import onload_quantization

        quantization = onload_quantization(self.quantization, source)
        fp8 = getattr(source, "fp8_block", None)
        if fp8 is not None:
            chosen = "the default" if self.quantization == "auto" else "--quantization"
            if quantization == "none":
                what = "every weight dequantized to the model dtype (--quantization none)"
            else:
                what = f"CPU workers re-block its linears into {quantization.upper()} ({chosen})"
            logger.info(
                "%s: %s weights; %s, GPU workers dequantize them to the model dtype",
                source.path,
                fp8.describe(),
                what,
            )
        return quantization

    def kept_cpu_blocks(
        self, source: ModelSource, hf_config: Any, kernels: KernelConfig
    ) -> GGUFBlockSizes | None:
        """What CPU workers keep as GGUF blocks under these flags (None: every weight float;
        loader/block_sizes.py); a block-scaled FP8 folder counts as its re-blocked type. The
        kernels are asked for (and built) only when there are blocks to keep."""
        from hybridllm.loader.block_sizes import cpu_block_sizes
        from hybridllm.loader.fp8_block import onload_quantization
        from hybridllm.plan.cpu_dtype import cpu_kernels_built

        quantization = onload_quantization(self.quantization, source)
        return cpu_block_sizes(
            source, hf_config, quantization, lambda: cpu_kernels_built(kernels.cpu_kernels)
        )

    def kernel_config(self) -> KernelConfig:
        """The kernel settings: those given, the environment's for the rest; KernelConfig
        validates them."""
        return KernelConfig.from_env(
            self.cpu_kernels, self.gguf_activations, self.native_decode_layer
        )

    def _cpu_auto_dtype(self, hf_config, cpu_blocks, quantization: str) -> str:
        """What dtype "auto" computes in on CPU workers (plan/cpu_dtype.py): the hardware
        profile is read (measured once per machine) only for a bf16 checkpoint on a bf16 CPU."""
        from hybridllm.plan.cpu_dtype import auto_dtype_for

        if self.dtype != "auto":
            return "float32"

        def gemm_rates() -> tuple[float, float]:
            from hybridllm.plan.hardware_profile import load_or_measure_profile
            from hybridllm.platforms.discovery import discover_hardware

            cpu = load_or_measure_profile(discover_hardware()).cpu
            return cpu.fp32_flops, cpu.bf16_flops

        return auto_dtype_for(hf_config, quantization, cpu_blocks, gemm_rates)

    def _build_plan(
        self,
        hf_config,
        max_num_batched_tokens: int,
        max_model_len: int,
        cpu_blocks=None,
        cpu_auto_dtype: str = "float32",
        int8_blocks: bool = False,
        speculative_config: SpeculativeConfig | None = None,
    ) -> Plan:
        """Place the model: the planner reads the flags, the hardware and (with a GPU) measured rates."""
        from hybridllm.plan.cost_model import CostModel
        from hybridllm.plan.hardware_profile import load_or_measure_profile
        from hybridllm.plan.planner import build_plan
        from hybridllm.platforms.discovery import discover_hardware

        placement = self.placement_args(
            max_model_len, max_num_batched_tokens, cpu_auto_dtype, int8_blocks, speculative_config
        )
        nodes = None
        if self.distributed_executor_backend == "ray":
            from hybridllm.executor import ray_cluster
            from hybridllm.plan.cluster import cluster_hardware

            ray_cluster.connect(self.ray_address)
            nodes = ray_cluster.cluster_nodes()
            hw = cluster_hardware(nodes)
        else:
            hw = discover_hardware()
        # Measuring rates costs seconds; only a machine with a GPU has a split to decide.
        cost = CostModel(load_or_measure_profile(hw)) if hw.num_gpus else None
        plan = build_plan(hf_config, placement, hw, cost, cpu_blocks)
        if nodes is not None:
            from hybridllm.plan.cluster import assign_nodes

            plan = assign_nodes(plan, nodes, self.cpu_threads)
        return plan

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every engine flag (hybridllm/engine_flags.py, the one table of them)."""
        from hybridllm.engine_flags import add_engine_flags  # it reads this class's defaults

        add_engine_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def parse_layer_split(split: str | list[int] | tuple[int, ...] | None) -> list[int] | None:
    """'10,20' or [10, 20] -> [10, 20]; None stays None (an even split)."""
    if split is None:
        return None
    parts = split.split(",") if isinstance(split, str) else list(split)
    try:
        counts = [int(p) for p in parts]
    except (TypeError, ValueError):
        raise ValueError(
            f"layer_split must be layer counts per stage like '10,20', got {split!r}"
        ) from None
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"layer_split needs at least one layer per stage, got {split!r}")
    return counts


def _optional_size(value: str | int | None) -> int | None:
    return None if value is None else parse_memory_size(value)


def _resolve_dtype(dtype: str, device: str, cpu_auto: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else cpu_auto


def _check_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> None:
    """A cache dtype other than the compute dtype is a 16-bit one under fp32 compute."""
    if kv_cache_dtype in ("auto", dtype):
        return
    if dtype != "float32" or kv_cache_dtype == "float32":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with {dtype} compute: the KV cache holds the "
            "compute dtype, or float16/bfloat16 under float32 compute"
        )


def _keeps_recurrent_state(hf_config) -> bool:
    """Whether some layer of the model keeps a recurrent state (linear attention), which a
    rejected draft would leave advanced past the kept tokens."""
    return any(spec.is_state for spec in kv_cache_groups(hf_config))


def _eos_token_ids(generation_config: dict, hf_config) -> tuple[int, ...]:
    eos = generation_config.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

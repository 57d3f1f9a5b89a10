"""`PlacementArgs`: the user's placement flags, frozen and validated once; memory sizes like '8GiB'."""

from __future__ import annotations

import re
from dataclasses import dataclass

PLACEMENT_DEVICES = ("auto", "cuda", "cpu", "heterogeneous")
PLACEMENT_DTYPES = ("auto", "float32", "bfloat16", "float16")
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}  # fmt: skip


def parse_memory_size(text: str | int) -> int:
    """'8GiB' -> 8589934592, '1.5GB' -> 1500000000, '512' -> 512 (bytes)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read memory size {text!r}: expected a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 8GiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class PlacementArgs:
    """What the user asked of the placement. tp = pp = 1 means "not asked": the planner decides.

    `kv_reserve_tokens` is the KV cache (in tokens, across all sequences) that must fit beside
    the weights, e.g. max_num_seqs * a typical context, or max_model_len.
    `max_num_batched_tokens` sizes the activation workspace each device keeps free.
    """

    device: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_layers: int | None = None  # like llama.cpp -ngl: the last N layers (and LM head) on the GPU
    max_gpu_memory: int | None = None  # bytes, per GPU
    max_cpu_memory: int | None = None  # bytes, all CPU workers together
    gpu_memory_utilization: float = 0.9
    layer_split: tuple[int, ...] | None = None  # layers per pipeline stage
    cpu_threads: int | None = None  # per CPU worker
    kv_reserve_tokens: int = 4096
    max_num_batched_tokens: int = 2048
    # sequences at once: what sliding-window layers' bounded KV cache is reserved for
    max_num_seqs: int = 128
    dtype: str = "auto"
    # what "auto" means when no GPU runs layers (plan/cpu_dtype.py): "float32" or "bfloat16"
    cpu_auto_dtype: str = "float32"
    # CPU workers' KV cache (plan/cpu_dtype.py's cpu_kv_cache_dtype): the user's kv_cache_dtype,
    # and whether they compute GGUF blocks with int8 activations (where "auto" stores float16)
    kv_cache_dtype: str = "auto"
    int8_blocks: bool = False
    # CPU stages beside a GPU stream their weights to it for steps of at least this many
    # tokens: None = the cost model's crossover, -1 = never, 0 = always
    stream_threshold: int | None = None
    # where CPU stages stream to: None = the plan's first GPU; "cpu" runs the streaming path
    # on the host (it checks the staging logic on machines without a GPU; never faster)
    stream_device: str | None = None
    # Mixtures of experts (llama.cpp's --cpu-moe / --n-cpu-moe): the routed experts of every
    # layer, or of the first N layers, on the CPU while the rest of those layers stays on the GPU
    cpu_moe: bool = False
    n_cpu_moe: int | None = None
    # speculative decoding's "mtp" method: the last stage also holds the MTP layer and its KV
    mtp: bool = False
    # host bytes the engine's process holds outside the plan (a draft model's weights and KV),
    # taken from the CPU budget; `host_reserved_note` says what they are
    host_reserved_bytes: int = 0
    host_reserved_note: str = ""

    def __post_init__(self) -> None:
        if self.device not in PLACEMENT_DEVICES:
            raise ValueError(f"device must be one of {PLACEMENT_DEVICES}, got {self.device!r}")
        if self.dtype not in PLACEMENT_DTYPES:
            raise ValueError(f"dtype must be one of {PLACEMENT_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in PLACEMENT_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {PLACEMENT_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.cpu_auto_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"cpu_auto_dtype must be 'float32' or 'bfloat16', got {self.cpu_auto_dtype!r}"
            )
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_gpu_memory", "max_cpu_memory", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 when given, got {value}")
        if self.stream_threshold is not None and self.stream_threshold < -1:
            raise ValueError(
                f"stream_threshold must be -1 (never), 0 (always) or a token count, "
                f"got {self.stream_threshold}"
            )
        if self.stream_device is not None and not (
            self.stream_device == "cpu" or self.stream_device.startswith("cuda")
        ):
            raise ValueError(
                f"stream_device must be 'cpu' or 'cuda[:N]', got {self.stream_device!r}"
            )
        if self.n_cpu_moe is not None and self.n_cpu_moe < 0:
            raise ValueError(f"n_cpu_moe must be >= 0, got {self.n_cpu_moe}")
        if self.cpu_moe and self.n_cpu_moe is not None:
            raise ValueError("give cpu_moe or n_cpu_moe, not both")
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise ValueError(f"gpu_layers must be >= 0, got {self.gpu_layers}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_reserve_tokens < 0:
            raise ValueError(f"kv_reserve_tokens must be >= 0, got {self.kv_reserve_tokens}")
        if self.layer_split is not None:
            if not self.layer_split or any(n < 1 for n in self.layer_split):
                raise ValueError(
                    f"layer_split needs one positive layer count per stage, got {self.layer_split}"
                )
            if self.pipeline_parallel_size not in (1, len(self.layer_split)):
                raise ValueError(
                    f"layer_split has {len(self.layer_split)} stages but "
                    f"pipeline_parallel_size is {self.pipeline_parallel_size}"
                )
            if self.gpu_layers is not None:
                raise ValueError("give gpu_layers or layer_split, not both")
        if self.device == "cpu" and self.gpu_layers:
            raise ValueError(f"gpu_layers={self.gpu_layers} asks for a GPU but device is 'cpu'")

    def cpu_expert_prefix(self, num_layers: int) -> int:
        """How many first layers the user put the routed experts of on the CPU (0: none asked)."""
        if self.cpu_moe:
            return num_layers
        return min(self.n_cpu_moe or 0, num_layers)

    @property
    def num_stages(self) -> int:
        return len(self.layer_split) if self.layer_split else self.pipeline_parallel_size

    @property
    def explicit_layout(self) -> bool:
        """Did the user fix the worker layout (tp, pp or a layer split)?"""
        return self.tensor_parallel_size > 1 or self.num_stages > 1

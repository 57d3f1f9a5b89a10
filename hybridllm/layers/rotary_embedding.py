"""Rotary position embedding (RoPE, rotate-half layout) with default, linear, llama3 and YaRN
scaling, GGUF's per-frequency divisors (`freq_factors`, from a `rope_freqs` tensor), and a
rotary part narrower than the head (`partial_rotary_factor`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_INITIAL_CACHE_POSITIONS = 4096  # grown on demand: a 128k-position table would cost 64+ MB


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings of an HF config, as one dict with `rope_theta` and `rope_type`.

    transformers 5 keeps them in `rope_parameters`; 4.x in `rope_theta` + `rope_scaling`.
    """
    params: dict[str, Any] = {}
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    params.update(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dimensions of a head rotate (`partial_rotary_factor` of it)."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0)))


def compute_inv_freq(
    head_dim: int, params: dict[str, Any], partial_rotary: bool = False
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32), scaled as `params["rope_type"]` says, then
    divided by `params["freq_factors"]` when given (llama.cpp's rope_freqs).

    `head_dim` is the rotated width; a model that rotates only part of each head passes that
    part's width and `partial_rotary=True` (elsewhere a partial factor is refused)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0 and not partial_rotary:
        raise ValueError(f"partial_rotary_factor != 1 is not supported: {params}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, head_dim, params)
    factors = params.get("freq_factors")
    if factors is not None:
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"rope freq_factors has {len(factors)} entries, head_dim {head_dim} needs "
                f"{head_dim // 2}"
            )
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend in between."""
    factor = float(params["factor"])
    low_factor = float(params["low_freq_factor"])
    high_factor = float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # smooth in (0, 1) for wavelengths between old_context/high_factor and old_context/low_factor
    smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context / high_factor) & (wavelen <= old_context / low_factor)
    return torch.where(is_medium, blended, scaled)


def _yarn_scale(inv_freq: torch.Tensor, dim: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, ramp
    linearly between the dimensions that turn beta_slow and beta_fast times over the original
    context."""
    factor = float(params["factor"])
    base = float(params["rope_theta"])
    old_context = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency, unchanged), 0: interpolate
    return (inv_freq / factor) * (1 - keep) + inv_freq * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the original."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(params: dict[str, Any]) -> float:
    """What YaRN multiplies cos and sin by (1 for the other RoPE types)."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


@dataclass(frozen=True)
class RotaryAngles:
    """One model step's rotation: cos and signed sin of each token, each [num_tokens, 1, D]."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    native: bool = False  # CPU: rotate with the compiled hybridllm::rotary_embedding_

    def rotate_(self, x: torch.Tensor) -> None:
        """Rotate x [num_tokens, num_heads, head_dim] (may be a strided view) in place."""
        if self.native:
            torch.ops.hybridllm.rotary_embedding_(x, self.cos, self.sin_signed)
        else:
            apply_rotary_(x, self.cos, self.sin_signed)


class RotaryEmbedding(nn.Module):
    """Holds a [max_positions, 2, head_dim] table of (cos, signed sin) in the model dtype.

    `forward(positions, max_seq_len)` gathers it once per model step into `RotaryAngles`,
    which then rotate q and k of every layer in place.
    """

    def __init__(
        self,
        head_dim: int,
        params: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
        partial_rotary: bool = False,
    ):
        """`head_dim`: the rotated width (`partial_rotary`: a part of each head, which the
        model slices before rotating)."""
        super().__init__()
        self.head_dim = head_dim
        self.dtype = dtype
        self.native = False  # CPU: the compiled rotation (see use_native_op)
        self.scale = attention_factor(params)
        inv_freq = compute_inv_freq(head_dim, params, partial_rotary)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer(
            "cos_sin_cache", self._build(_INITIAL_CACHE_POSITIONS), persistent=False
        )

    def _build(self, num_positions: int) -> torch.Tensor:
        positions = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq)  # [P, D/2], fp32 as in HF
        cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
        # signed sin [-sin, sin] turns rotate_half(x) * sin into swap_halves(x) * signed_sin
        cos_full = torch.cat((cos, cos), dim=-1)
        sin_signed = torch.cat((-sin, sin), dim=-1)
        return torch.stack((cos_full, sin_signed), dim=1).to(self.dtype)  # [P, 2, D]

    def recast_(self, dtype: torch.dtype) -> None:
        """Compute in `dtype` with the torch rotation: what a copy of the table on another
        device (the weight streamer's accelerator) does."""
        self.dtype, self.native = dtype, False
        self.cos_sin_cache = self._build(self.cos_sin_cache.shape[0])

    def use_native_op(self) -> None:
        """Rotate with the compiled CPU op: one pass over q and k where torch's cat + mul_ +
        addcmul_ make three. Call only when `load_cpu_kernels()` is True."""
        self.native = True

    def ensure_capacity(self, num_positions: int) -> None:
        """Grow the table to cover positions < num_positions (host-side check, no sync)."""
        if num_positions > self.cos_sin_cache.shape[0]:
            size = max(num_positions, 2 * self.cos_sin_cache.shape[0])
            self.cos_sin_cache = self._build(size)

    def forward(self, positions: torch.Tensor, max_seq_len: int) -> RotaryAngles:
        """The rotation of each token at `positions`."""
        self.ensure_capacity(max_seq_len)
        cos_sin = self.cos_sin_cache.index_select(0, positions)  # [n, 2, D]
        return RotaryAngles(cos_sin[:, 0:1], cos_sin[:, 1:2], self.native and positions.is_cpu)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """Rotate x [num_tokens, num_heads, head_dim] (may be a strided view) in place.

    Same math as HF's `x * cos + rotate_half(x) * sin` (neox / rotate-half layout).
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [n, h, D]
    x.mul_(cos).addcmul_(swapped, sin_signed)

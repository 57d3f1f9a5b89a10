"""Random draws for sampling: stateless per-request seeds and the sync-free exponential race."""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One splitmix64 round: a bijective 64-bit mix, so nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_step_seed(seed: int, num_output_tokens: int) -> int:
    """The seed of a request's draw at one step, a pure function of (seed, step).

    Being stateless is the point: a request draws the same token whether it runs alone,
    in any batch, or is recomputed after preemption.
    """
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (num_output_tokens & _MASK64))
    return mixed >> 1  # torch seeds are taken as uint64 but keep it positive for clarity


def make_row_generator(seed: int, num_output_tokens: int, device: torch.device) -> torch.Generator:
    """A generator on `device` for one seeded row's draw at this step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_step_seed(seed, num_output_tokens))
    return generator


def exponential_race(
    probs: torch.Tensor, generators: dict[int, torch.Generator], skip_batched_draw: bool = False
) -> torch.Tensor:
    """Sample one token per row of `probs` [num_rows, vocab] without a host sync.

    argmax(p_i / E_i) with E_i ~ Exponential(1) picks token i with probability p_i (the
    Gumbel-max trick in another form), and unlike torch.multinomial needs no sync.
    Rows in `generators` draw their noise from their own generator; the others share one
    batched draw from the default generator (skipped when `skip_batched_draw`, i.e. every
    row that matters is seeded).
    """
    noise = torch.empty_like(probs)  # [num_rows, vocab]
    if skip_batched_draw:
        noise.fill_(1.0)  # rows without a generator are discarded by the caller
    else:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # exponential_ may return exactly 0 (then 0/0 = nan would win the argmax).
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)

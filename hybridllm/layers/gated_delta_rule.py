"""The gated delta rule and its causal conv1d in plain torch: the forms the native ops match."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    starts: list[int],
    fresh: list[bool],
    slots: list[int],
) -> torch.Tensor:
    """silu(causal depthwise conv) of each sequence's rows of x [T, C] fp32 -> [T, C].

    weight [C, K]; conv_state [slots, C, K-1] holds each slot's last K-1 inputs (oldest first)
    and is updated in place; sequence s owns rows [starts[s], starts[s+1]).
    """
    hist = weight.shape[1] - 1
    out = torch.empty_like(x)
    for s, slot in enumerate(slots):
        rows = x[starts[s] : starts[s + 1]].t()  # [C, L]
        prior = torch.zeros_like(conv_state[slot]) if fresh[s] else conv_state[slot]
        window = torch.cat([prior, rows], dim=1)  # [C, K-1 + L]
        conv = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=x.shape[1])[0]
        out[starts[s] : starts[s + 1]] = F.silu(conv).t()
        conv_state[slot] = window[:, window.shape[1] - hist :]
    return out


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last dim (the FLA library's epsilon placement)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of B rows: q, k [B, H, Dk] (normalized, q scaled), v [B, H, Dv], g, beta
    [B, H] fp32; state [B, H, Dk, Dv] fp32 updated in place -> out [B, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)  # what the state recalls for k
    delta = (v - predicted) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One sequence in chunks of CHUNK tokens: q, k [L, H, Dk] (normalized, q scaled), v
    [L, H, Dv], g, beta [L, H] fp32; state [H, Dk, Dv] fp32 updated in place -> [L, H, Dv].

    Within a chunk the L sequential rank-one updates are one lower-triangular system (the UT
    transform of DeltaNet): with A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i (G the
    chunk's cumulative log decay), (I + A) u = beta v and (I + A) w = beta k exp(G); the chunk
    then reads and writes the carried state with matrix products only.
    """
    length = q.shape[0]
    pad = -length % CHUNK
    # [H, N, C, D]: heads first, then chunks; zero padding (beta 0, g 0) leaves the state as is
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).t() for x in (g, beta))
    heads = q.shape[0]
    q, k, v = (x.reshape(heads, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(heads, -1, CHUNK) for x in (g, beta))

    cum = g.cumsum(-1)  # [H, N, C] log decay from the chunk start through token i
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # decay between tokens j <= i, masked before exp so that j > i cannot overflow
    gap = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * gap  # [H, N, C, C]; the diagonal is beta k.k
    system = system.tril(-1) + torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * gap  # [H, N, C, C] within-chunk attention
    q_decayed = q * cum.exp().unsqueeze(-1)  # reads the state as it was at the chunk start
    last = cum[..., -1:]  # [H, N, 1]
    k_decayed = k * (last - cum).exp().unsqueeze(-1)  # decayed to the chunk end
    out = torch.empty_like(v)
    for n in range(q.shape[1]):
        v_new = u[:, n] - w[:, n] @ state  # [H, C, Dv] the part the state does not predict
        out[:, n] = q_decayed[:, n] @ state + scores[:, n] @ v_new
        state.mul_(last[:, n].exp().unsqueeze(-1)).add_(k_decayed[:, n].transpose(-1, -2) @ v_new)
    return out.reshape(heads, -1, v.shape[-1])[:, :length].transpose(0, 1)

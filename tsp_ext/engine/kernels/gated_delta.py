"""The gated delta rule (Gated DeltaNet's linear attention) in pure PyTorch, differentiable.

Per value head, with a state ``S [dk, dv]``: ``S_t = e^{g_t} (I - β_t k_t k_tᵀ) S_{t-1} +
β_t k_t v_tᵀ`` and ``o_t = S_tᵀ q_t``. Inputs are already l2-normalised (q also scaled by
``dk^-1/2``) and expanded to the value heads. Both kernels compute in float64 for float64
inputs, float32 otherwise (Hugging Face's always cast to float32), and return that dtype. On
CUDA, where flash-linear-attention (``fla``) is installed, the chunked kernel is its Triton
``chunk_gated_delta_rule`` (states in float32, its own backward) instead.
"""

from __future__ import annotations

import functools

import torch

CHUNK = 64


@functools.cache
def _fla_chunk():
    """flash-linear-attention's ``chunk_gated_delta_rule``, or None where it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def uses_fla(x: torch.Tensor) -> bool:
    """Whether ``chunk_gated_delta`` runs ``x``'s kernel with fla (CUDA, not float64)."""
    return x.is_cuda and x.dtype != torch.float64 and _fla_chunk() is not None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, float32 for every narrower dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunked(inputs: tuple[torch.Tensor, ...], state):
    """WY-chunked scan of one stream (as Hugging Face's ``torch_chunk_gated_delta_rule``):
    ``inputs = (q, k, v, g, beta)``, ``[B, H, T, ...]`` in the compute dtype, T a multiple of
    ``CHUNK``."""
    q, k, v, g, beta = inputs
    B, H, T, dk = k.shape
    n = T // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(B, H, n, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(B, H, n, CHUNK).cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    solve = torch.linalg.solve_triangular
    values = solve(system, v_beta, upper=False, unitriangular=True)
    k_cum = solve(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(n):
        v_new = values[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=2), state


def chunk_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over ``T`` tokens in chunks of 64 (T any length: padded at the end with
    g = β = 0, which leaves the state unchanged).

    q, k ``[B, T, H, dk]``; v ``[B, T, H, dv]``; g, beta ``[B, T, H]``; state ``[B, H, dk, dv]``
    (zeros if None); ``resets [B, T]`` (bool): the state is zeroed before those tokens (a packed
    document's first token). Returns ``(o [B, T, H, dv], final state [B, H, dk, dv])`` in the
    compute dtype."""
    B, T, H, dk = k.shape
    acc = compute_dtype(q.dtype)
    if state is None:
        state = q.new_zeros(B, H, dk, v.shape[-1], dtype=acc)
    state = state.to(acc)
    if resets is not None:
        state = state * (~resets[:, 0]).to(acc)[:, None, None, None]
        cuts = resets[:, 1:].any(0).nonzero().flatten().add(1).tolist()
        if cuts:  # run the pieces between reset positions in turn
            outs = []
            for a, b in zip([0, *cuts], [*cuts, T]):
                piece = (t[:, a:b] for t in (q, k, v, g, beta))
                o, state = chunk_gated_delta(*piece, state=state, resets=resets[:, a:b])
                outs.append(o)
            return torch.cat(outs, dim=1), state
    if uses_fla(q):  # scale 1: q comes scaled; the state in float32, as fla keeps it
        o, state = _fla_chunk()(
            q, k, v, g.float(), beta, scale=1.0, initial_state=state.float().contiguous(),
            output_final_state=True,
        )  # fmt: skip
        return o.to(acc), state
    pad = (-T) % CHUNK
    inputs = tuple(
        torch.nn.functional.pad(
            x.transpose(1, 2).to(acc), (0, 0, 0, pad) if x.dim() == 4 else (0, pad)
        )
        for x in (q, k, v, g, beta)
    )
    o, state = _chunked(inputs, state)
    return o[:, :, :T].transpose(1, 2), state


def recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (decode: one or a few steps); shapes as
    ``chunk_gated_delta``, ``state`` required. Returns ``(o, final state)`` in the compute
    dtype."""
    acc = compute_dtype(q.dtype)
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    state = state.to(acc)
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1), state

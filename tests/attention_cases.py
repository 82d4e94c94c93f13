"""One Hugging Face attention module against its ``TSPAttention`` on the same full sequence, on
this rank of a gloo group: training (outputs and every gradient; packed rows) and inference
(prefill, then decode steps). Shared by the module-level attention tests (``test_sinks``,
``test_gated_attention``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from checks import doc_positions, hf_mask, rel_err

from tsp_ext import TSPAttention, TSPConfig, ZigzagLayout, pad_sequence, padded_length
from tsp_ext.hf.cache import TSPCacheLayer
from tsp_ext.hf.families import LLAMA
from tsp_ext.hf.spec import Family


def _same(tables):
    return tables


class AttentionCase:
    """An HF attention module ``attn`` (float64), its rotary ``rope(x, pos) -> (cos, sin)``,
    ``tsp_rope`` turning those tables into what ``TSPAttention`` takes, and its ``family``."""

    def __init__(self, attn, rope, family: Family = LLAMA, tsp_rope: Callable = _same) -> None:
        self.attn, self.rope, self.family, self.tsp_rope = attn, rope, family, tsp_rope
        self.window = getattr(attn, "sliding_window", None)
        self.hidden = attn.config.hidden_size

    def tsp(self, config: TSPConfig | None = None) -> TSPAttention:
        config = config or TSPConfig(attn_block=4)
        return TSPAttention.from_hf(self.attn, dist.group.WORLD, config, self.family)

    def tables(self, x: torch.Tensor, pos: torch.Tensor):
        return self.tsp_rope(self.rope(x, pos))

    def training(self, rank: int, world: int, B: int, S: int, docs=None, config=None) -> dict:
        """Errors of one causal stream of S tokens, or (``docs``: each row's document lengths)
        packed rows: output, dx and every parameter's gradient (``config``: the TSPConfig, by
        default blocks of 4)."""
        attn = self.attn
        attn.zero_grad()
        torch.manual_seed(100 + S)
        x = torch.randn(B, S, self.hidden, dtype=torch.float64)
        dy = torch.randn_like(x)
        full_pos = torch.arange(S).expand(B, S) if docs is None else doc_positions(docs)
        xr = x.clone().requires_grad_()
        yr, _ = attn(xr, self.rope(x, full_pos), hf_mask(full_pos, self.window))
        (yr * dy).sum().backward()

        lay = ZigzagLayout(padded_length(S, world), world)
        pos = lay.positions(rank)
        real = pos < S
        kw = {}
        if docs is not None:  # S a multiple of 2D: no padding
            pos = kw["position_ids"] = lay.shard(full_pos, rank)
        t_attn = self.tsp(config)

        def local(t):  # this rank's real tokens of a full [B, S, ...] tensor
            return lay.shard(pad_sequence(t, world, 0.0), rank)[:, real]

        xl = lay.shard(pad_sequence(x, world, 0.0), rank).requires_grad_()
        yl, _ = t_attn(xl, position_embeddings=self.tables(xl, pos.expand(B, -1)), **kw)
        (yl * lay.shard(pad_sequence(dy, world, 0.0), rank)).sum().backward()
        errs = {
            "out": rel_err(yl[:, real], local(yr.detach())),
            "dx": rel_err(xl.grad[:, real], local(xr.grad)),
        }
        ref = dict(attn.named_parameters())
        for name, p in t_attn.named_parameters():
            errs[name] = rel_err(p.grad, t_attn.local_slice(name, ref[name].grad))
        return errs

    def inference(self, rank: int, world: int, B: int, S: int, steps: int) -> dict:
        """Errors of a prefill of S tokens, then ``steps`` single tokens, against the HF module
        on all S + steps tokens (causal: each position's output is the same either way)."""
        L = S + steps
        torch.manual_seed(200 + S)
        x = torch.randn(B, L, self.hidden, dtype=torch.float64)
        with torch.no_grad():
            full_pos = torch.arange(L).expand(B, L)
            ref, _ = self.attn(x, self.rope(x, full_pos), hf_mask(full_pos, self.window))
        t_attn = self.tsp()
        c = t_attn.spec.kv_replicas
        cache = TSPCacheLayer(c, rank % c, t_attn.spec.window)
        lay = ZigzagLayout(padded_length(S, world), world)
        pos = lay.positions(rank)
        real = pos < S
        xl = lay.shard(pad_sequence(x[:, :S], world, 0.0), rank)
        y = t_attn.prefill(xl, self.tables(xl, pos[None].expand(B, -1)), cache, S)
        want = lay.shard(pad_sequence(ref[:, :S], world, 0.0), rank)[:, real]
        errs = {"prefill": rel_err(y[:, real], want)}
        for t in range(S, L):
            index = torch.tensor([t])
            xt = x[:, t : t + 1]
            y = t_attn.decode(xt, self.tables(xt, index[None].expand(B, 1)), cache, index)
            errs[f"decode{t - S}"] = rel_err(y, ref[:, t : t + 1])
        return errs

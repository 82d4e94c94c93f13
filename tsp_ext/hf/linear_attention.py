"""``TSPGatedDeltaNet``: Hugging Face's ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``
replaced by its TSP head group.

The schedule is ``tsp_ext.engine.linear_attention.schedule``; this module holds the shards under the
Hugging Face names (rows of this rank's head group in each input projection: Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba``, or Qwen3.5's ``in_proj_q`` / ``in_proj_k`` / ``in_proj_v``
(its ``in_proj_qkv`` split by ``hf.layers.unfuse``) / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``;
``out_proj`` columns; ``conv1d.weight``, ``A_log``, ``dt_bias``, ``norm.weight`` replicated),
slices them from a Hugging Face module and checks the call. ``prefill`` / ``decode`` are its
inference steps; ``cache.LinearStateCacheLayer`` holds its group's conv and recurrent state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import TSPConfig
from ..engine.kernels.gated_delta import recurrent_gated_delta
from ..engine.linear_attention.schedule import (
    Documents,
    GroupCall,
    LayerWeights,
    LinearAttentionSpec,
    causal_conv,
    documents,
    gated_rms,
    group_forward,
    heads,
    project,
    tsp_gated_delta,
)
from ..engine.parallel import comm
from ..engine.sharding.documents import query_spans
from ..engine.sharding.layout import ZigzagLayout
from .attention import SPANS_KWARG
from .cache import LinearStateCacheLayer
from .families import LLAMA
from .sharding import ShardedModule
from .spec import Family

_SHARED = ("conv1d", "out_proj", "A_log", "dt_bias", "norm")
# the Gated DeltaNet input projections TSP folds: Qwen3-Next's (per key head: q | k | v | z rows,
# then b | a), Qwen3.5's (q of all key heads | k | v, then z, b, a apart; in_proj_qkv split in
# in_proj_q / in_proj_k / in_proj_v once TSP is applied)
_LAYOUTS = (
    ("in_proj_qkvz", "in_proj_ba"),
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a"),
)
# Hugging Face's module of each input projection the engine names (``spec.projections``: the
# fused qkvz / ba, or q, k, v, z, b, a apart)
_HF_PROJECTION = {name: f"in_proj_{name}" for name in ("qkvz", "ba", *"qkvzba")}
_HF_NAME = {hf: name for name, hf in _HF_PROJECTION.items()}


def check_linear_attention(name: str, i: int, module: nn.Module | None) -> None:
    """Raise ``ValueError`` naming the model unless layer ``i``'s linear-attention ``module`` is a
    Gated DeltaNet that TSP folds: Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` or
    Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, with
    ``conv1d`` (bias-free, depthwise, causal; SiLU), ``out_proj``, ``A_log``, ``dt_bias`` and a
    gated ``norm``."""
    missing = [n for n in _SHARED if not hasattr(module, n)]
    if missing or not any(all(hasattr(module, n) for n in names) for names in _LAYOUTS):
        kind = type(module).__name__
        raise ValueError(
            f"{name} layer {i}: linear attention {kind} is not a Gated DeltaNet TSP folds: it "
            "needs conv1d, out_proj, A_log, dt_bias, norm and either Qwen3-Next's in_proj_qkvz / "
            "in_proj_ba or Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a"
        )
    activation = getattr(module, "activation", "silu")
    if module.conv1d.bias is not None or activation not in ("silu", "swish"):
        raise ValueError(
            f"{name} layer {i}: a Gated DeltaNet conv with a bias or a {activation} "
            "activation is not supported under TSP (Qwen3-Next's: no bias, SiLU)"
        )


class TSPGatedDeltaNet(ShardedModule):
    """Gated DeltaNet linear attention on a TSP axis; holds head group p.

    ``forward(hidden_states [B, S/D, h], cache=None, attention_mask=None, **kwargs)`` as Hugging
    Face's (zigzag tokens; ``attention_mask``: an optional local ``[B, S/D]`` 0/1 mask zeroing
    padded tokens' hidden states; ``kwargs[SPANS_KWARG]``: packed documents' query spans, or
    ``position_ids``) returns ``[B, S/D, h]``.
    """

    shard_dims = {"in_proj_qkvz.weight": 0, "in_proj_ba.weight": 0, "out_proj.weight": 1}

    def small_replicated(self) -> list[nn.Parameter]:
        return [self.conv1d.weight]

    def __init__(
        self,
        spec: LinearAttentionSpec,
        group,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        D, p = comm.size_and_rank(group)
        if D != spec.tsp_size:
            raise ValueError(
                f"process group has {D} ranks but the spec is for tsp_size={spec.tsp_size}"
            )
        self.spec, self.group = spec, group
        kw = {"dtype": dtype, "device": device}
        for name in spec.projections:
            rows = spec.rows(name, p)
            linear = nn.Linear(spec.hidden, rows.stop - rows.start, bias=False, **kw)
            setattr(self, _HF_PROJECTION[name], linear)
        cols = spec.out_cols(p)
        self.out_proj = nn.Linear(cols.stop - cols.start, spec.hidden, bias=False, **kw)
        channels = 2 * spec.n_k_heads * spec.dk + spec.n_v_heads * spec.dv
        self.conv1d = nn.Conv1d(channels, channels, spec.conv, groups=channels, bias=False, **kw)
        self.A_log = nn.Parameter(torch.zeros(spec.n_v_heads, **kw))
        self.dt_bias = nn.Parameter(torch.ones(spec.n_v_heads, **kw))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(spec.dv, **kw))

    @classmethod
    def from_hf(
        cls, module: nn.Module, group, config: TSPConfig | None = None, family: Family = LLAMA
    ) -> TSPGatedDeltaNet:
        """Build from a Hugging Face ``Qwen3NextGatedDeltaNet`` or ``Qwen3_5GatedDeltaNet`` (its
        ``in_proj_qkv`` split, ``hf.layers.unfuse``), copying this rank's slices (``config`` and
        ``family`` as ``TSPAttention.from_hf`` takes them; the layer reads neither: its layout
        is the module's)."""
        if hasattr(module, "in_proj_qkv"):
            raise ValueError(
                "a Qwen3.5 Gated DeltaNet's in_proj_qkv must be split into in_proj_q / in_proj_k "
                "/ in_proj_v first (hf.layers.unfuse, as apply_tsp does)"
            )
        spec = LinearAttentionSpec(
            hidden=module.hidden_size,
            n_k_heads=module.num_k_heads,
            n_v_heads=module.num_v_heads,
            dk=module.head_k_dim,
            dv=module.head_v_dim,
            conv=module.conv_kernel_size,
            eps=module.norm.variance_epsilon,
            tsp_size=dist.get_world_size(group),
            separate=hasattr(module, "in_proj_q"),
        )
        w = module.out_proj.weight
        kind = SeparateTSPGatedDeltaNet if spec.separate else cls
        mod = kind(spec, group, dtype=w.dtype, device=w.device)
        full = dict(module.named_parameters())
        with torch.no_grad():
            for name, param in mod.named_parameters():
                param.copy_(mod.local_slice(name, full[name]))
        return mod

    def index_of(self, name: str, rank: int) -> tuple[slice, ...]:
        """Index of group ``rank``'s slice in the full Hugging Face tensor behind ``name``."""
        if name == "out_proj.weight":
            return (slice(None), self.spec.out_cols(rank))
        engine_name = _HF_NAME.get(name.removesuffix(".weight"))
        if name.endswith(".weight") and engine_name in self.spec.projections:
            return (self.spec.rows(engine_name, rank),)
        return (slice(None),)

    def _own(self) -> tuple[torch.Tensor, ...]:
        """This rank's input projection rows (``spec.projections``), then its ``out_proj``
        columns."""
        names = (*(_HF_PROJECTION[n] for n in self.spec.projections), "out_proj")
        return tuple(getattr(self, n).weight for n in names)

    def _replicated(self) -> tuple[torch.Tensor, ...]:
        return (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        x = hidden_states
        if x.dim() != 3 or x.shape[-1] != self.spec.hidden:
            raise ValueError(
                f"hidden_states must be [B, S/D, {self.spec.hidden}], got {tuple(x.shape)}"
            )
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("TSP linear attention has no cache in training: use_cache=False")
        D, p = comm.size_and_rank(self.group)
        layout = ZigzagLayout.from_local(x.shape[1], D)
        if attention_mask is not None:
            if attention_mask.shape != x.shape[:2]:
                raise ValueError(
                    f"attention_mask must be this rank's [B, S/D] = {tuple(x.shape[:2])} 0/1 "
                    f"mask, got {tuple(attention_mask.shape)}"
                )
            x = (x * attention_mask[:, :, None]).to(x.dtype)
        spans, pos = kwargs.get(SPANS_KWARG), kwargs.get("position_ids")
        if spans is None and pos is not None:
            spans = query_spans(pos, layout, p)
        docs = documents(spans, layout, p, x.device)
        rep = tuple(comm.replicated(t, self.group) for t in self._replicated())
        call = GroupCall(self.spec, self.group, docs)
        return tsp_gated_delta(x, LayerWeights(self._own(), rep), call)

    @torch.no_grad()
    def prefill(
        self,
        x: torch.Tensor,
        position_embeddings,
        cache_layer: LinearStateCacheLayer,
        prompt_len: int,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inference: this rank's prompt tokens ``x [B, S'/D, h]`` (zigzag, right-padded to S';
        the padded tail is an identity transition); ``key_valid [B, S']`` (bool) marks left
        padding, whose hidden states are zeroed as Hugging Face does. This rank's group's final
        state and last K-1 pre-conv rows go to ``cache_layer``. ``position_embeddings`` unused
        (no rotary). Returns ``[B, S'/D, h]``."""
        D, p = comm.size_and_rank(self.group)
        B, T, _ = x.shape
        pos = ZigzagLayout.from_local(T, D).positions(p, x.device)
        if key_valid is not None:
            x = (x * key_valid[:, pos, None]).to(x.dtype)
        width = self.spec.conv - 1
        tail = torch.arange(prompt_len - width, prompt_len, device=x.device)  # global rows

        def keep(r: int, states: list[torch.Tensor], qkv: torch.Tensor) -> None:
            rows = qkv.new_zeros(B, width, qkv.shape[-1])
            here = (pos[:, None] == tail[None]).nonzero()  # [(local, tail slot)]
            rows[:, here[:, 1]] = qkv[:, here[:, 0]]
            comm.reduce(rows, r, self.group)
            if r == p:
                cache_layer.store(rows, states[-1], prompt_len)

        docs = Documents(torch.zeros(1, T, dtype=torch.long, device=x.device), pos)
        identity = (pos >= prompt_len)[None].expand(B, T)
        call = GroupCall(self.spec, self.group, docs, keep=keep, identity=identity)
        weights = LayerWeights(self._own(), self._replicated())
        y = 0
        for r in range(D):
            y = y + group_forward(r, call, x, weights)
        return y

    @torch.no_grad()
    def decode(
        self,
        x: torch.Tensor,
        position_embeddings,
        cache_layer: LinearStateCacheLayer,
        q_index: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inference: TP step of ``x [B, Tq, h]`` (the same on every rank) at global indices
        ``q_index [Tq]``: this rank's group's projections, conv and recurrent steps from
        ``cache_layer``, its ``out_proj`` columns, one all-reduce. ``valid [B, L + Tq]`` (bool)
        zeroes padded tokens. Returns ``[B, Tq, h]``, the same on every rank."""
        p = dist.get_rank(self.group)
        spec = self.spec
        if valid is not None:
            x = (x * valid[:, q_index, None]).to(x.dtype)
        *w_in, w_out = self._own()
        nk = spec.k_heads(p).stop - spec.k_heads(p).start
        qkv, z, b, a = project(x, w_in, spec, nk)
        w = torch.cat([self.conv1d.weight[ch, 0] for ch in spec.conv_channels(p)])
        left = cache_layer.conv_state
        ok = torch.ones(1, x.shape[1], spec.conv, dtype=torch.bool, device=x.device)
        mixed = causal_conv(qkv, left, w, ok)
        v_heads = spec.v_heads(p)
        rule = heads(
            mixed, b, a, A_log=self.A_log[v_heads], dt_bias=self.dt_bias[v_heads], spec=spec, nk=nk
        )
        o, state = recurrent_gated_delta(*rule, cache_layer.recurrent_state)
        conv_state = torch.cat([left, qkv], dim=1)[:, -(spec.conv - 1) :]
        cache_layer.store(conv_state, state, int(q_index[-1]) + 1)
        o = gated_rms(o.to(x.dtype), z, self.norm.weight, spec.eps)
        y = F.linear(o.flatten(2), w_out)
        comm.all_reduce(y, self.group)
        return y


class SeparateTSPGatedDeltaNet(TSPGatedDeltaNet):
    """``TSPGatedDeltaNet`` in Qwen3.5's layout (``LinearAttentionSpec.separate``; ``from_hf``
    builds it for a ``Qwen3_5GatedDeltaNet``): rows of ``in_proj_q`` / ``in_proj_k`` /
    ``in_proj_v`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``."""

    shard_dims = {
        **{f"in_proj_{n}.weight": 0 for n in "qkvzba"},
        "out_proj.weight": 1,
    }

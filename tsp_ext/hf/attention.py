"""``TSPAttention``: the Hugging Face attention module replaced by its TSP head group.

The schedule itself (broadcast of head-group weights, K/V all-gather, hand-written backward) is
``tsp_ext.engine.attention.schedule``; this module holds the shards under the Hugging Face names,
slices them from a Hugging Face module and checks the call. ``prefill`` / ``decode`` are its
inference steps with a KV cache (``hf.inference`` runs the layers through them).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import TSPConfig
from ..engine.attention.head_groups import AttentionInputs
from ..engine.attention.heads import ShardKind, shard_name
from ..engine.attention.qk_rms import decode_qk_rms, qk_rms
from ..engine.attention.qkv import GroupProjection, QKNorms, Tokens, project_qkv
from ..engine.attention.schedule import AttentionSpec, tsp_attention, tsp_attention_prefill
from ..engine.decode import decode_attention, row_parallel
from ..engine.kernels.pointwise import rope_phases
from ..engine.parallel import comm
from ..engine.sharding.documents import query_spans
from ..engine.sharding.layout import ZigzagLayout
from .families import LLAMA
from .lora import adapters_of, plan_of
from .nf4 import storage
from .sharding import Role, ShardedModule
from .spec import Family

# keyword argument carrying the local query spans of packed documents from the model's input check
# (``causal_lm.check_inputs``) to every layer's attention: derived once per forward, not per layer
SPANS_KWARG = "tsp_query_spans"


def full_width(
    cos: torch.Tensor, sin: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables over the rotated dims: gpt-oss's give one angle per pair of halves
    (``[..., d/2]``, applied to the two halves of each head), the same rotation as rotate-half
    RoPE with the angles repeated."""
    if spec.rotary_dim is not None or cos.shape[-1] * 2 != spec.head_dim:
        return cos, sin
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def split_gate(w: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's q_proj rows ``[n·2d, h]`` (per head: d query rows, then d gate rows) -> the
    query rows and the gate rows, ``[n·d, h]`` each (differentiable copies)."""
    heads = w.view(-1, 2, head_dim, w.shape[-1])
    return heads[:, 0].reshape(-1, w.shape[-1]), heads[:, 1].reshape(-1, w.shape[-1])


def rotary_dim(cfg, head_dim: int) -> int | None:
    """The dims of each head RoPE rotates when the config's ``partial_rotary_factor`` is below 1
    (``int(head_dim · factor)``, as Hugging Face's rotary tables), else None."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return None if factor == 1.0 else int(head_dim * factor)


class TSPAttention(ShardedModule):
    """Self-attention of any supported family on a TSP axis; holds head group p of every projection.

    Same call signature as Hugging Face's ``LlamaAttention``: ``hidden_states [B, S/D, h]`` in
    zigzag layout and ``position_embeddings = (cos, sin)`` of those tokens' positions;
    returns ``(output [B, S/D, h], None)``. ``position_ids`` restarting at 0 per document (packed
    rows, ``engine.sharding.documents``) make attention causal within each document and blocked
    across documents; plain global positions give one causal stream. Parameters keep the Hugging
    Face names; q/k/v_proj hold rows, o_proj columns of this rank's head group; o_proj's bias, the
    q/k norms and gpt-oss's ``sinks [n_heads]`` (one logit per query head in its softmax's
    denominator; if any) are replicated, their gradients summed over the TSP group. A projection
    may be a ``TSPLoraLinear`` (PEFT LoRA, ``hf.lora``): its adapter joins the schedule.
    """

    # dim along which each sharded parameter is cut (others are replicated)
    shard_dims = {
        "q_proj.weight": 0,
        "q_proj.bias": 0,
        "k_proj.weight": 0,
        "k_proj.bias": 0,
        "v_proj.weight": 0,
        "v_proj.bias": 0,
        "o_proj.weight": 1,
    }

    def __init__(
        self,
        spec: AttentionSpec,
        group,
        config: TSPConfig | None = None,
        *,
        biases: tuple[bool, bool] = (False, False),
        qk_norms: tuple[nn.Module, nn.Module] | None = None,
        sinks: bool = False,
        dtype=None,
        device=None,
    ) -> None:
        super().__init__()
        qkv_bias, o_bias = biases  # on q/k/v, on o
        D, p = comm.size_and_rank(group)
        if D != spec.tsp_size:
            raise ValueError(
                f"process group has {D} ranks but the spec is for tsp_size={spec.tsp_size}"
            )
        if (qk_norms is None) != (spec.qk_norm_eps is None):
            raise ValueError(
                "qk_norms (q_norm, k_norm) must be given exactly when spec.qk_norm_eps is set"
            )
        q_norm, k_norm = qk_norms or (None, None)
        self.spec, self.group = spec, group
        self.options = (config or TSPConfig()).engine_options()
        h, d = spec.hidden_size, spec.head_dim
        kw = {"dtype": dtype, "device": device}
        nq, nk = (
            spec.n_q(p) * d,
            spec.n_kv(p) * d,
        )  # this rank's head group (engine.attention.heads)
        if spec.output_gate and qkv_bias:
            raise ValueError("q/k/v biases with an output-gated attention are not supported")
        # an output gate's rows sit in q_proj after each head's query rows (Qwen3-Next)
        self.q_proj = nn.Linear(h, nq * (2 if spec.output_gate else 1), bias=qkv_bias, **kw)
        self.k_proj = nn.Linear(h, nk, bias=qkv_bias, **kw)
        self.v_proj = nn.Linear(h, nk, bias=qkv_bias, **kw)
        self.o_proj = nn.Linear(nq, h, bias=o_bias, **kw)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.sinks = nn.Parameter(torch.zeros(spec.n_heads, **kw)) if sinks else None

    @classmethod
    def from_hf(
        cls, attn: nn.Module, group, config: TSPConfig | None = None, family: Family = LLAMA
    ) -> TSPAttention:
        """Build from a Hugging Face attention module of ``family``, copying this rank's slices
        of its weights (its sliding window and q/k norms' kind read through the family; its
        attention sinks, gpt-oss's ``sinks``, copied whole)."""
        cfg = attn.config
        D, p = comm.size_and_rank(group)
        # replicated per-head norms (Qwen3): private copies, so the HF module can be discarded
        q_norm, k_norm = (copy.deepcopy(getattr(attn, n, None)) for n in ("q_norm", "k_norm"))
        spec = AttentionSpec(
            hidden_size=cfg.hidden_size,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=attn.head_dim,
            tsp_size=D,
            scaling=attn.scaling,
            qk_norm_eps=getattr(q_norm, family.norm_eps) if q_norm is not None else None,
            qk_norm_offset=family.norm_offset if q_norm is not None else 0.0,
            qk_norm_full=q_norm is not None and q_norm.weight.numel() != attn.head_dim,
            window=family.sliding_window(attn),
            rotary_dim=rotary_dim(cfg, attn.head_dim),
            output_gate=attn.q_proj.weight.shape[0] == 2 * cfg.num_attention_heads * attn.head_dim,
        )
        if spec.qk_norm_full and attn.q_proj.bias is not None:
            raise ValueError(
                "q/k norms over the whole projection with q/k biases are not supported under TSP"
            )
        w = attn.q_proj.weight
        mod = cls(
            spec,
            group,
            config,
            biases=(attn.q_proj.bias is not None, attn.o_proj.bias is not None),
            qk_norms=None if q_norm is None else (q_norm, k_norm),
            sinks=getattr(attn, "sinks", None) is not None,
            dtype=w.dtype,
            device=w.device,
        )
        full = dict(attn.named_parameters())
        with torch.no_grad():
            for name, param in mod.named_parameters():
                param.copy_(mod.local_slice(name, full[name]))
        return mod

    def index_of(self, name: str, rank: int) -> tuple[slice, ...]:
        """Index of group ``rank``'s slice in the full (Hugging Face) tensor behind ``name``."""
        if name not in self.shard_dims:
            return (slice(None),)
        q_or_o = name.startswith(("q_", "o_"))
        rows = self.spec.q_rows(rank) if q_or_o else self.spec.kv_rows(rank)
        if self.spec.output_gate and name.startswith("q_"):  # each head's query and gate rows
            rows = slice(2 * rows.start, 2 * rows.stop)
        return (slice(None), rows) if self.shard_dims[name] == 1 else (rows,)

    def counted_index(self, name: str) -> tuple[slice, ...]:
        """K/V rows of the heads whose first user is this rank (a shared head counts once)."""
        p = dist.get_rank(self.group)
        if not name.startswith(("k_proj.", "v_proj.")) or not self.spec.first_kv_copied(p):
            return super().counted_index(name)
        heads, d = self.spec.counted_kv(p), self.spec.head_dim
        return (slice(heads.start * d, heads.stop * d),)

    def role(self, name: str) -> Role:
        """K/V slices whose every head's first user is another rank are ``Role.COPY``."""
        kv = name.startswith(("k_proj.", "v_proj."))
        counted = self.spec.counted_kv(dist.get_rank(self.group))
        if kv and counted.start == counted.stop:
            return Role.COPY
        return super().role(name)

    def _own(self, merged: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shards by the engine's names, as they travel (QLoRA: NF4-packed bytes);
        ``merged``: dequantized, with active LoRA adapters added (inference)."""
        projs = {"wq": self.q_proj, "wo": self.o_proj, "wk": self.k_proj, "wv": self.v_proj}
        if merged:
            own = {
                n: p.merged_weight() if hasattr(p, "merged_weight") else p.weight
                for n, p in projs.items()
            }
        else:
            own = {n: storage(p) for n, p in projs.items()}
        if self.spec.output_gate:
            own["wq"], own["wg"] = split_gate(own["wq"], self.spec.head_dim)
        if self.q_proj.bias is not None:
            own.update(bq=self.q_proj.bias, bk=self.k_proj.bias, bv=self.v_proj.bias)
        return own

    def _qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.q_norm is None:
            return None, None
        return self.q_norm.weight, self.k_norm.weight

    def _qk_rms(self, x: torch.Tensor, own: dict[str, torch.Tensor]):
        """The tokens' full-width q/k reciprocal RMS ``(rq, rk)`` (``engine.attention.qk_rms``)
        when the model's q/k norms span the whole projection, else None."""
        if not self.spec.qk_norm_full:
            return None
        wq, wk = own["wq"], own["wk"]
        return qk_rms(x, wq, wk, spec=self.spec, group=self.group, options=self.options)

    def _inputs(self, x, position_embeddings, own, replicate: bool, **call) -> AttentionInputs:
        """One call's ``AttentionInputs`` for tokens ``x`` at ``position_embeddings``, with
        the shards ``own``; the replicated q/k norm weights and sinks wrapped so that their
        gradient sums over the group where ``replicate`` (training), as they are otherwise;
        ``call``: the call's own fields (query spans, LoRA pieces)."""
        cos, sin = full_width(*position_embeddings, self.spec)
        shared = [*self._qk_norms(), self.sinks]
        if replicate:
            shared = [w if w is None else comm.replicated(w, self.group) for w in shared]
        q_norm, k_norm, sinks = shared
        rms = self._qk_rms(x, own)
        return AttentionInputs(
            x=x, cos=cos, sin=sin, weights=own, q_norm=q_norm, k_norm=k_norm, rms=rms, sinks=sinks,
            **call,
        )  # fmt: skip

    def _with_o_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.o_proj.bias is None else y + self.o_proj.bias

    @torch.no_grad()
    def prefill(
        self,
        x: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache_layer,
        prompt_len: int,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inference: attention of this rank's prompt tokens ``x [B, S'/D, h]`` (zigzag, the
        prompt right-padded to S'); the all-gathered K/V of this rank's own head group, first
        ``prompt_len`` tokens, go to ``cache_layer`` (a ``TSPCacheLayer``) at no extra traffic.
        ``key_valid [B, S']`` (bool) hides left-padded keys. Returns ``[B, S'/D, h]``."""
        p = dist.get_rank(self.group)

        def keep(r: int, k_all: torch.Tensor, v_all: torch.Tensor) -> None:
            if r == p:
                index = torch.arange(prompt_len, device=x.device)
                cache_layer.append(
                    k_all[:, :prompt_len].transpose(1, 2),
                    v_all[:, :prompt_len].transpose(1, 2),
                    index,
                )

        inputs = self._inputs(x, position_embeddings, self._own(merged=True), replicate=False)
        y = tsp_attention_prefill(
            inputs, self.spec, self.group, self.options, kv_sink=keep, key_valid=key_valid
        )
        return self._with_o_bias(y)

    @torch.no_grad()
    def decode(
        self,
        x: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache_layer,
        q_index: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inference: TP attention of a decode step's tokens ``x [B, Tq, h]`` (the same on every
        rank) at global indices ``q_index [Tq]`` over this rank's cached heads, whose new K/V join
        ``cache_layer``; ``valid [B, L + Tq]`` (bool) marks the non-padding tokens. Returns
        ``[B, Tq, h]``, the same on every rank."""
        cos, sin = full_width(*position_embeddings, self.spec)
        own = self._own(merged=True)
        phases = rope_phases(cos, sin, x.dtype, self.spec.head_dim)
        q_norm, k_norm = self._qk_norms()
        rms = None
        if self.spec.qk_norm_full:  # this group's slices; the RMS over every group's heads
            p = dist.get_rank(self.group)
            q_norm, k_norm = q_norm[self.spec.q_rows(p)], k_norm[self.spec.kv_rows(p)]
            pre = (F.linear(x, own[n]) for n in ("wq", "wk"))
            rms = decode_qk_rms(*pre, spec=self.spec, group=self.group, p=p)
        norms = QKNorms(q_norm, k_norm, rms)
        q, kv, _ = project_qkv(Tokens(x, phases), GroupProjection(own, norms=norms), self.spec)
        keys, values, index = cache_layer.append(*kv.chunk(2, dim=1), q_index)
        allowed = (index[None, :] <= q_index[:, None])[None]  # [1, Tq, L_p]
        if self.spec.window is not None:
            allowed = allowed & (index[None, :] > q_index[:, None] - self.spec.window)
        if valid is not None:
            allowed = allowed & valid[:, None, index]
        sinks = None
        if self.sinks is not None:
            sinks = self.sinks[self.spec.q_heads(dist.get_rank(self.group))]
        a = decode_attention(
            q,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            allowed,
            spec=self.spec,
            group=self.group,
            sinks=sinks,
        ).flatten(2)
        if self.spec.output_gate:
            a = a * torch.sigmoid(F.linear(x, own["wg"]))
        y = row_parallel(a, own["wo"], self.group, self.options.accum_for(x.dtype))
        return self._with_o_bias(y)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        x = hidden_states
        if x.dim() != 3 or x.shape[-1] != self.spec.hidden_size:
            raise ValueError(
                f"hidden_states must be [B, S/D, {self.spec.hidden_size}], got {tuple(x.shape)}"
            )
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("TSP attention has no KV cache: call the model with use_cache=False")
        if attention_mask is not None:
            raise ValueError(
                "TSP attention is causal by global position and takes no attention_mask; right "
                "padding needs none (padded tokens come last and carry ignored labels)"
            )
        spans, pos = kwargs.get(SPANS_KWARG), kwargs.get("position_ids")
        if spans is None and pos is not None:  # called without the model's input check
            D, p = comm.size_and_rank(self.group)
            spans = query_spans(pos, ZigzagLayout.from_local(x.shape[1], D), p)
        own = self._own()
        adapted = adapters_of(self, ("q_proj", "k_proj", "v_proj", "o_proj"))
        if self.spec.output_gate and "q_proj" in adapted:
            raise ValueError(
                "LoRA on q_proj of an output-gated attention (Qwen3-Next: q_proj holds the gate's "
                "rows too) is not supported under TSP: target k/v/o_proj and the MLP"
            )
        plan = plan_of(adapted, ("q_proj", "k_proj", "v_proj"), "o_proj", self.training)
        for n in ("q", "k", "v"):
            if f"{n}_proj" in adapted:
                own[shard_name(ShardKind.LORA, n)] = adapted[f"{n}_proj"].b
        b_out = None
        if plan.output is not None:
            own["lo"] = adapted["o_proj"].a
            b_out = comm.replicated(adapted["o_proj"].b, self.group)
        lora_a = [comm.replicated(adapted[f"{n}_proj"].a, self.group) for n in plan.inputs]
        if self.spec.qk_norm_full and ("q_proj" in adapted or "k_proj" in adapted):
            raise ValueError(
                "LoRA on q_proj / k_proj of a model with q/k norms over the whole projection "
                "(OLMo-2) is not supported under TSP: target the other projections"
            )
        inputs = self._inputs(
            x, position_embeddings, own, replicate=True,
            q_spans=spans, lora=plan, lora_a=tuple(lora_a), b_out=b_out,
        )  # fmt: skip
        y = tsp_attention(inputs, self.spec, self.group, self.options)
        if self.o_proj.bias is not None:
            y = y + comm.replicated(self.o_proj.bias, self.group)
        return y, None

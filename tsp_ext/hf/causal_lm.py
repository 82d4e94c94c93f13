"""What a TSP causal LM does differently at call time: the global loss, the vocab-sharded
``forward`` (fused ring LM head + cross-entropy) and the input check that rejects batches not
made by ``shard_batch`` (and derives the query spans of packed documents once per call)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..engine.parallel import comm
from ..engine.parallel.agreement import agree, checksum
from ..engine.sharding.documents import check_chunks, local_error, query_spans
from ..engine.sharding.layout import IGNORE_INDEX, ZigzagLayout
from .attention import SPANS_KWARG

NEEDS_SHIFT_LABELS = (
    "a TSP model needs labels shifted before sharding: build the batch with tsp_ext.shard_batch "
    "(it returns shift_labels)"
)


class TSPCausalLMLoss:
    """Causal-LM loss of a TSP model: the token mean over the whole TSP group's batch.

    Same value as Hugging Face's ``ForCausalLMLoss`` on the full batch (at least float32 logits,
    ignored labels excluded), identical on every TSP rank; its backward gives every rank exactly its
    tokens' share (no factor of D). ``num_items_in_batch``, if given, is the *global* number of
    target tokens (e.g. across gradient-accumulation steps).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if shift_labels is None:
            raise ValueError(NEEDS_SHIFT_LABELS)
        # float32 at least, as Hugging Face does; float64 models keep float64
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        local = F.cross_entropy(
            logits.reshape(-1, vocab_size),
            shift_labels.reshape(-1).to(logits.device),
            ignore_index=ignore_index,
            reduction="sum",
        )
        return self.global_mean(local, shift_labels, num_items_in_batch, ignore_index)

    def token_count(
        self,
        shift_labels: torch.Tensor,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> tuple[torch.Tensor, comm.Pending]:
        """The global number of target tokens, ``(count, handle)``: the count is summed over the
        TSP group asynchronously and valid once ``handle.wait()`` returns."""
        if num_items_in_batch is not None:
            return torch.as_tensor(num_items_in_batch, device=shift_labels.device), comm.Pending([])
        count = (shift_labels != ignore_index).sum()
        return count, comm.Pending([comm.all_reduce(count, self.group, async_op=True)])

    def global_mean(
        self,
        local_sum: torch.Tensor,
        shift_labels: torch.Tensor,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        *,
        count: tuple[torch.Tensor, comm.Pending] | None = None,
    ) -> torch.Tensor:
        """Sum of every rank's ``local_sum`` over the global number of target tokens
        (``count``: what ``token_count`` returned, if it was started earlier)."""
        total, counting = count or self.token_count(shift_labels, num_items_in_batch, ignore_index)
        counting.wait()
        return comm.sum_over_ranks(local_sum, self.group) / total.to(local_sum.device)


@dataclass
class TSPCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus, with ``return_token_logps``, the local tokens'
    ``token_logps [B, S/D]`` (log p(label), 0 where the label is ignored; differentiable) and
    the requested ``token_stats`` (``{name: [B, S/D]}``, no gradient); for MoE models with
    ``output_router_logits``, the global ``aux_loss`` and every MoE layer's local
    ``router_logits [B·S/D, E]`` (as Hugging Face's ``MoeCausalLMOutputWithPast``)."""

    token_logps: torch.Tensor | None = None
    token_stats: dict[str, torch.Tensor] | None = None
    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class OutputRequest:
    """What a vocab-sharded forward is asked to return besides the loss: ``return_logits``,
    ``return_token_logps`` (True or a tuple of ``engine.vocab.STATS`` names) and
    ``return_dict``, as the call's keyword arguments name them."""

    return_logits: bool = False
    return_token_logps: bool | tuple[str, ...] = False
    return_dict: bool | None = None

    @classmethod
    def pop(cls, kwargs: dict) -> OutputRequest:
        """Take the request out of a forward's ``kwargs``; drops ``use_cache`` (training keeps no
        cache) and refuses ``logits_to_keep`` (every token is local)."""
        if kwargs.pop("logits_to_keep", 0):
            raise ValueError(
                "logits_to_keep is not supported by a TSP model (every token is local)"
            )
        kwargs.pop("use_cache", None)
        names = ("return_logits", "return_token_logps", "return_dict")
        return cls(**{k: kwargs.pop(k) for k in names if k in kwargs})


def logits_input(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """What the LM head multiplies: the final hidden states ``[..., h]``, divided by the family's
    logits divisor (Granite's ``logits_scaling``) where it has one: the head is linear, so the
    logits, the loss and the token log-probabilities come out divided."""
    family = model.tsp.family
    divisor = family.scalar(model.config, family.logits_divisor)
    return hidden if divisor == 1.0 else hidden / divisor


def vocab_sharded_forward(
    self,
    input_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    **kwargs,
) -> CausalLMOutputWithPast:
    """``forward`` of a TSP causal LM whose embedding and LM head are vocab-sharded; ``kwargs``:
    the base model's, and the ``OutputRequest``'s.

    With ``labels`` the loss is computed by the fused ring LM head + cross-entropy and no logits
    are built (``logits`` is None) unless ``return_logits=True``; without labels the logits of
    the local tokens ``[B, S/D, V]`` are returned, as Hugging Face does.

    ``return_token_logps=True`` (with labels) also returns ``token_logps [B, S/D]``, each local
    token's log p(label) from the same ring (``sequence_logps`` sums them per sequence); a tuple
    of ``engine.vocab.STATS`` names (``"entropy"``, ...) adds those as ``token_stats``.
    """
    asked = OutputRequest.pop(kwargs)
    return_token_logps = asked.return_token_logps
    count = None
    if labels is not None:
        if shift_labels is None:
            raise ValueError(NEEDS_SHIFT_LABELS)
        # the token count's all-reduce flies during the whole forward
        count = self.loss_function.token_count(shift_labels, num_items_in_batch)
    outputs = self.tsp.family.base_of(self)(
        input_ids=input_ids,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=False,
        **kwargs,
    )
    hidden = logits_input(self, outputs.last_hidden_state)
    loss = logits = token_logps = token_stats = None
    if return_token_logps is not False and labels is None:
        raise ValueError("return_token_logps needs labels (and shift_labels: shard_batch)")
    if labels is not None:
        if return_token_logps is False:
            local = self.lm_head(hidden, shift_labels)
        else:
            stats = () if return_token_logps is True else tuple(return_token_logps)
            token_logps, token_stats = self.lm_head(hidden, shift_labels, per_token=stats)
            local = -token_logps.sum()
        loss = self.loss_function.global_mean(local, shift_labels, count=count)
    if labels is None or asked.return_logits:
        logits = self.lm_head(hidden)
    out = TSPCausalLMOutput(
        loss=loss,
        logits=logits,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        token_logps=token_logps,
        token_stats=token_stats or None,
    )
    return out.to_tuple() if asked.return_dict is False else out


def replicated_head_forward(
    self,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    return_dict: bool | None = None,
    return_logits: bool = True,
    **kwargs,
) -> CausalLMOutputWithPast:
    """``forward`` of a TSP causal LM with a replicated LM head (``shard_vocab=False``) from the
    local tokens' embeddings: logits ``[B, S/D, V]`` (always: ``return_logits`` is accepted for
    the vocab-sharded forward's callers) and, with labels, the global loss."""
    outputs = self.tsp.family.base_of(self)(
        inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False, **kwargs
    )
    logits = getattr(self, self.tsp.family.lm_head)(logits_input(self, outputs.last_hidden_state))
    loss = None
    if labels is not None:
        vocab = self.config.get_text_config().vocab_size
        loss = self.loss_function(
            logits, labels, vocab, num_items_in_batch, shift_labels=shift_labels
        )
    out = CausalLMOutputWithPast(loss=loss, logits=logits)
    return out.to_tuple() if return_dict is False else out


def check_inputs(model: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: reject inputs that would silently give wrong results under TSP (calls
    with a KV cache are checked by the inference path instead) and hand every layer's attention
    the local query spans its ``position_ids`` describe (packed documents:
    ``engine.sharding.documents``).

    Runs before the first collective of the call, and every rank of the TSP group raises the same
    ``ValueError`` when any rank's inputs are invalid (``engine.parallel.agreement``): no rank is
    left waiting in a collective, and a caller that catches the error can go on with the next batch.
    """
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return None
    every = model.tsp.config.checkpoint_every
    if every > 1 and model.training and kwargs.get("output_hidden_states"):
        raise ValueError(
            f"output_hidden_states with checkpoint_every={every}: the layers inside an interval "
            "run at its last layer, so their hidden states are not the layers' own; train with "
            "output_hidden_states=False or checkpoint_every=1"
        )
    if kwargs.get("fused_lm_head") and kwargs.get("shift_labels") is None:
        return None  # a full batch: hf.log_probs shards it and checks the shards (check_shards)
    return args, check_shards(model, kwargs, args)


def check_shards(
    model: nn.Module, kwargs: dict, args: tuple = (), full_batch: dict | None = None
) -> dict:
    """``check_inputs``' checks of a call's inputs (collective); returns ``kwargs`` plus the
    local query spans for the attention. ``full_batch``: the full batch the call sharded itself,
    which must be the same on every rank of the TSP group (compared by a checksum)."""
    state = model.tsp
    D, p = comm.size_and_rank(state.group)
    vocab = model.config.get_text_config().vocab_size
    error, facts = _local_error(args, kwargs, vocab, D=D, p=p)
    if full_batch is not None:
        facts = facts + [checksum(full_batch[k]) for k in sorted(full_batch)]
    table = agree(error, facts, state.group)
    if (table[:, :2] != table[0, :2]).any():
        rows = enumerate(table[:, :2].tolist())
        shapes = ", ".join(f"rank {r}: [{b}, {t}]" for r, (b, t) in rows)
        raise ValueError(
            f"the TSP ranks got local batches of different shapes ({shapes}): every rank of a "
            "TSP group must shard the same full batch with tsp_ext.shard_batch"
        )
    if (table[:, 3:] != table[0, 3:]).any():
        raise ValueError(
            "the TSP ranks got different full batches: every rank of a TSP group must read the "
            "same batches (split the data over the dp ranks only, e.g. TSPTrainerMixin)"
        )
    pos = kwargs["position_ids"]
    layout = ZigzagLayout.from_local(pos.shape[-1], D)
    if table[:, 2].any():  # per-document positions somewhere: do the chunks fit together?
        check_chunks(pos, layout, state.group)
    return {**kwargs, SPANS_KWARG: query_spans(pos, layout, p)}


def _local_error(
    args: tuple, kwargs: dict, vocab_size: int, *, D: int, p: int
) -> tuple[str | None, list[int]]:
    """Why this rank's call cannot run, or None; and ``[B, S/D, packed]`` to compare across
    ranks (``packed``: 1 if the position ids are per-document, not the global ones)."""
    pos = kwargs.get("position_ids")
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    tokens = ids if ids is not None else embeds
    shaped = tokens is not None and tokens.dim() >= 2
    facts = [tokens.shape[0], tokens.shape[1], 0] if shaped else [-1, -1, 0]
    if args:
        return "call a TSP model with keyword arguments: model(**shard_batch(...))", facts
    if kwargs.get("logits_to_keep"):
        return "logits_to_keep is not supported by a TSP model (every token is local)", facts
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        return NEEDS_SHIFT_LABELS, facts
    if kwargs.get("attention_mask") is not None:
        return (
            "a TSP model takes no attention_mask: pass the full batch's mask to "
            "tsp_ext.shard_batch, which turns right padding into ignored labels"
        ), facts
    if pos is None:
        return (
            "a TSP model needs the global position_ids of its tokens: use tsp_ext.shard_batch",
            facts,
        )
    if not shaped:
        return "a TSP model needs input_ids [B, S/D] (or inputs_embeds [B, S/D, h])", facts
    B, T = facts[:2]
    try:
        layout = ZigzagLayout.from_local(T, D)
    except ValueError as e:
        return str(e), facts
    labels = kwargs.get("shift_labels")
    for name, t in (("position_ids", pos), ("shift_labels", labels)):
        if t is not None and (t.dim() != 2 or t.shape[1] != T or t.shape[0] not in (1, B)):
            return f"{name} {tuple(t.shape)} must match input_ids [{B}, {T}]", facts
    if ids is not None:
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            within = f"[0, {vocab_size})"
            at = layout.positions(p)
            return _out_of_range("input_ids", ids, bad, positions=at, within=within), facts
    if labels is not None:
        bad = ((labels < 0) | (labels >= vocab_size)) & (labels != IGNORE_INDEX)
        if bad.any():
            within = f"[0, {vocab_size}) or {IGNORE_INDEX}"
            at = layout.positions(p)
            return _out_of_range("labels", labels, bad, positions=at, within=within), facts
    packed = not bool((pos == layout.positions(p, pos.device)).all())
    return (local_error(pos, layout, p) if packed else None), [B, T, int(packed)]


def _out_of_range(
    name: str, t: torch.Tensor, bad: torch.Tensor, *, positions: torch.Tensor, within: str
) -> str:
    """The message for a token id outside ``within``: its value, row and place in the full
    batch (``positions [T]``: the local tokens' global positions; a shifted label at global
    position g is the full batch's label at g + 1)."""
    b, j = (int(i) for i in bad.nonzero()[0])
    at = int(positions[j]) + (name == "labels")
    return (
        f"{name} must be in {within}, got {int(t[b, j])} in row {b} at position {at} of the "
        "full batch: check the tokenizer and the model's vocab_size"
    )

"""Vision-language models under TSP: the vision encoder's work split over the TSP group and its
features delivered to the ranks whose tokens hold them.

The language model is folded like any causal LM (``apply_tsp``, its ``Family.base`` a path such
as ``model.language_model``). The vision tower and its connector keep their weights replicated
on every TSP rank, but each rank encodes only its run of the batch's images / video slices
(``hf.vision_plan``), so no rank holds every image's activations. The merged features (and
Qwen3-VL's deepstack features, in the same message) go to the owners of their placeholder
tokens in one all-to-all, whose backward returns each feature's gradient to its encoder. The
tower's weight gradients, each rank's from its own images, are summed over the TSP group by
one all-reduce (``comm.replicated_together``).

``shard_vision_batch`` (called by ``shard_batch``) computes, on the full batch: this rank's
pixels, the exchange, and Qwen-VL's 3-D M-RoPE positions (``get_rope_index``, the model's own)
sharded with the tokens. ``vision_forward`` is the TSP training forward of such a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from ..engine.parallel import comm
from ..engine.sharding.layout import ZigzagLayout, pad_sequence
from .causal_lm import replicated_head_forward, vocab_sharded_forward
from .spec import VisionSpec
from .vision_plan import Units, deal, exchange, grid_units, image_units, pad_positions

# the Hugging Face processor's multimodal keys that shard_batch takes
BATCH_KEYS = (
    "pixel_values",
    "pixel_values_videos",
    "image_grid_thw",
    "video_grid_thw",
    "second_per_grid_ts",
    "mm_token_type_ids",
)
_LOCAL_INPUTS = (
    "a TSP vision-language model takes the local inputs shard_batch makes: "
    "model(**shard_batch(batch, mesh, model=model))"
)


def vision_parameters(model: nn.Module, spec: VisionSpec) -> dict[str, nn.Parameter]:
    """The vision modules' parameters by their names on ``spec.inner``."""
    inner = model.get_submodule(spec.inner)
    return {n: p for n, p in inner.named_parameters() if n.split(".")[0] in spec.modules}


def _units(model: nn.Module, spec: VisionSpec, batch: dict, n_image: int) -> Units:
    """The batch's vision units, checked against its placeholder tokens."""
    if spec.grids:
        grids = [batch.get("image_grid_thw"), batch.get("video_grid_thw")]
        merge = model.config.vision_config.spatial_merge_size
        return grid_units(grids, merge)
    n = 0 if batch.get("pixel_values") is None else batch["pixel_values"].shape[0]
    vision = model.config.vision_config
    per_image = (vision.image_size // vision.patch_size) ** 2
    per_image += model.config.vision_feature_select_strategy == "full"  # the CLS token kept
    if n_image != n * per_image:
        raise ValueError(
            f"{n_image} image tokens in input_ids do not match {n} images in pixel_values "
            f"({per_image} tokens each): check the processor's output"
        )
    return image_units(n, per_image)


def _check_counts(units: Units, batch: dict, n_tokens: list[int]) -> None:
    """Placeholder tokens and pixel rows against what the grids / images make."""
    for kind, (key, name) in enumerate(
        (("pixel_values", "image"), ("pixel_values_videos", "video"))
    ):
        features = sum(f for f, s in zip(units.features, units.source) if s == kind)
        if features != n_tokens[kind]:
            raise ValueError(
                f"{n_tokens[kind]} {name} tokens in input_ids do not match the {features} "
                f"{name} features that {key} and its grid make: every {name} needs its "
                "placeholder tokens (use the model's processor)"
            )
        rows = sum(p for p, s in zip(units.patches, units.source) if s == kind)
        got = 0 if batch.get(key) is None else batch[key].shape[0]
        if units.grid is not None and got != rows:
            raise ValueError(f"{key} has {got} patch rows, its grid {rows}")


def shard_vision_batch(
    model: nn.Module, batch: dict, lay: ZigzagLayout, p: int, *, positions: bool = True
) -> dict[str, torch.Tensor]:
    """This rank's vision inputs of a full multimodal batch, what ``vision_forward`` takes: its
    units' ``pixel_values`` (and their ``vision_grid_thw [U_p, 3]``), the exchange
    (``vision_order``, ``vision_counts``, ``vision_index``: ``vision_plan.Exchange``) and, with
    ``positions``, the M-RoPE rows ``rope_position_ids [3, B, S'/D]``; raises ``ValueError``
    (the same on every rank) if its placeholder tokens and images disagree."""
    spec = model.tsp.family.vision
    cfg = model.config
    ids = batch["input_ids"]
    B, S = ids.shape
    masks = [ids == cfg.image_token_id]
    masks.append(ids == cfg.video_token_id if spec.videos else torch.zeros_like(masks[0]))
    units = _units(model, spec, batch, int(masks[0].sum()))
    _check_counts(units, batch, [int(m.sum()) for m in masks])
    D = lay.size
    unit_rank = torch.tensor(deal(units.patches, D), dtype=torch.long, device=ids.device)
    features = torch.tensor(units.features, dtype=torch.long, device=ids.device)
    encoder_rank = unit_rank.repeat_interleave(features)
    slots = torch.cat([_slots(pad_sequence(m, D, False), lay.seq_len) for m in masks])
    ex = exchange(slots, encoder_rank, lay, B=B, p=p)
    mine = [u for u, r in enumerate(unit_rank.tolist()) if r == p]
    sources = (batch.get("pixel_values"), batch.get("pixel_values_videos"))
    if units.grid is None:
        pixels = sources[0][mine]
    else:
        pieces = [sources[units.source[u]].narrow(0, units.rows[u], units.patches[u]) for u in mine]
        pixels = torch.cat(pieces) if pieces else sources[0 if sources[0] is not None else 1][:0]
    out = {
        "pixel_values": pixels,
        "vision_order": ex.order,
        "vision_counts": ex.counts,
        "vision_index": ex.index,
    }
    if units.grid is not None:
        grids = torch.tensor([units.grid[u] for u in mine], dtype=torch.long, device=ids.device)
        out["vision_grid_thw"] = grids.view(-1, 3)
    if spec.mrope and positions:
        out["rope_position_ids"] = lay.shard(pad_positions(_rope_index(model, batch), D), p, dim=2)
    return out


def _slots(mask: torch.Tensor, S: int) -> torch.Tensor:
    """Flat ``b * S + s`` positions of a ``[B, S]`` mask's true entries, row-major."""
    b, s = mask.nonzero(as_tuple=True)
    return b * S + s


def _rope_index(model: nn.Module, batch: dict) -> torch.Tensor:
    """Qwen-VL's 3-D positions ``[3, B, S]`` of the full batch, by the model's own
    ``get_rope_index``."""
    cfg, ids = model.config, batch["input_ids"]
    types = batch.get("mm_token_type_ids")
    if types is None:
        types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    extra = {}
    if batch.get("second_per_grid_ts") is not None:
        extra["second_per_grid_ts"] = batch["second_per_grid_ts"]
    inner = model.get_submodule(model.tsp.family.vision.inner)
    pos, _ = inner.get_rope_index(
        ids,
        types,
        image_grid_thw=batch.get("image_grid_thw"),
        video_grid_thw=batch.get("video_grid_thw"),
        attention_mask=batch.get("attention_mask"),
        **extra,
    )
    return pos.long()


class _Encoder(nn.Module):
    """The vision side of a model, callable through ``functional_call`` with its parameters
    replaced (by views whose gradients are summed over the TSP group)."""

    def __init__(self, inner: nn.Module, spec: VisionSpec) -> None:
        super().__init__()
        self.inner, self.spec = inner, spec

    def forward(self, pixels: torch.Tensor, grids: torch.Tensor | None) -> list[torch.Tensor]:
        """Features ``[F, h]`` of the given units, then deepstack features ``[F, h]`` each."""
        if self.spec.grids:
            out = self.inner.visual(pixels.type(self.inner.visual.dtype), grid_thw=grids)
            return [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())]
        cfg = self.inner.config
        out = self.inner.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        )
        feats = out.pooler_output
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        return [feats.reshape(-1, feats.shape[-1])]


def encode(model: nn.Module, pixels: torch.Tensor, grids: torch.Tensor | None) -> torch.Tensor:
    """This rank's units encoded, ``[F_p, h · (1 + deepstack layers)]`` (one row per feature;
    deepstack features beside the merged ones), with the vision weights' gradients summed over
    the TSP group in backward (one all-reduce; a rank without units joins it with zeros). Every
    trainable vision weight gets a gradient, zero where unused (CLIP's last layer under LLaVA),
    as a data-parallel engine expects of every rank."""
    spec, group = model.tsp.family.vision, model.tsp.group
    inner = model.get_submodule(spec.inner)
    trainable = {n: p for n, p in vision_parameters(model, spec).items() if p.requires_grad}
    views = {}
    if trainable and torch.is_grad_enabled():
        views = dict(zip(trainable, comm.replicated_together(list(trainable.values()), group)))
    n_units = pixels.shape[0] if grids is None else grids.shape[0]
    if n_units == 0:
        width = model.config.get_text_config().hidden_size * (1 + _deepstack_layers(model))
        empty = pixels.new_zeros(0, width, dtype=model.dtype)
        # joins the gradients' all-reduce: the encoder's outputs depend on the views elsewhere
        return empty + next(iter(views.values())).reshape(-1)[:1].sum() * 0 if views else empty
    encoder = _Encoder(inner, spec)
    outs = functional_call(encoder, {f"inner.{n}": v for n, v in views.items()}, (pixels, grids))
    return torch.cat(outs, dim=-1)


def _deepstack_layers(model: nn.Module) -> int:
    if not model.tsp.family.vision.deepstack:
        return 0
    return len(model.config.vision_config.deepstack_visual_indexes)


class _Deliver(torch.autograd.Function):
    """forward: rows to their tokens' ranks (all-to-all with uneven splits).
    backward: their gradients back to the rows' encoders (the reverse all-to-all)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return comm.all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


@dataclass(frozen=True)
class VisionShard:
    """This rank's share of a batch's vision inputs, as ``shard_vision_batch`` makes them: its
    units' ``pixel_values`` (and ``grid_thw [U_p, 3]``, None without grids) and the feature
    exchange ``order``, ``counts``, ``index`` (``vision_plan.Exchange``)."""

    pixel_values: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    index: torch.Tensor
    grid_thw: torch.Tensor | None = None

    @classmethod
    def pop(cls, kwargs: dict) -> VisionShard | None:
        """Take ``shard_vision_batch``'s keys out of a forward's ``kwargs``; None when they
        carry no exchange (a text-only call)."""
        names = ("pixel_values", "vision_order", "vision_counts", "vision_index")
        pixels, order, counts, index = (kwargs.pop(k, None) for k in names)
        grid_thw = kwargs.pop("vision_grid_thw", None)
        if index is None:
            if pixels is not None:
                raise ValueError(_LOCAL_INPUTS)
            return None
        return cls(pixels, order, counts, index, grid_thw=grid_thw)


def merge_vision(
    model: nn.Module, embeds: torch.Tensor, shard: VisionShard
) -> tuple[torch.Tensor, dict]:
    """``embeds [B, S/D, h]`` of the local tokens with the vision features in their
    placeholders, and the language model's extra inputs (Qwen3-VL: the local deepstack
    features and their token mask)."""
    feats = encode(model, shard.pixel_values, shard.grid_thw)
    send, recv = shard.counts.tolist()
    got = _Deliver.apply(feats[shard.order], send, recv, model.tsp.group)
    where = shard.index >= 0
    rows = got[shard.index[where]].to(embeds.dtype)
    main, *deep = rows.split(embeds.shape[-1], dim=-1)
    embeds = embeds.masked_scatter(where[..., None], main)
    if not model.tsp.family.vision.deepstack:
        return embeds, {}
    return embeds, {"visual_pos_masks": where, "deepstack_visual_embeds": list(deep)}


def vision_forward(
    self,
    input_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    rope_position_ids: torch.Tensor | None = None,
    **kwargs,
):
    """Training / prefill ``forward`` of a TSP vision-language model on ``shard_batch``'s local
    inputs (its vision keys in ``kwargs``: ``VisionShard.pop``): the local tokens' embeddings
    with the vision features in their placeholders, the M-RoPE rows beside the global positions
    (``[4, B, S/D]``, as the Hugging Face language model takes them), then the causal LM's
    forward (``vocab_sharded_forward``, or the replicated head's)."""
    if kwargs.get("mm_encoder_outputs") is not None:
        raise ValueError(
            "precomputed vision features (mm_encoder_outputs) hold every image on every rank "
            "and cannot be split: pass the images (pixel_values), which TSP encodes 1/D per rank"
        )
    raw = sorted(k for k in BATCH_KEYS if k != "pixel_values" and kwargs.get(k) is not None)
    if raw:
        raise ValueError(_LOCAL_INPUTS)
    shard = VisionShard.pop(kwargs)
    family = self.tsp.family
    if inputs_embeds is None:
        inputs_embeds = getattr(family.base_of(self), family.embedding)(input_ids)
    if shard is not None:
        inputs_embeds, extra = merge_vision(self, inputs_embeds, shard)
        kwargs.update(extra)
    if rope_position_ids is not None:
        position_ids = torch.cat(
            [position_ids.expand_as(rope_position_ids[0])[None], rope_position_ids]
        )
    forward = vocab_sharded_forward if self.tsp.config.shard_vocab else replicated_head_forward
    return forward(self, inputs_embeds=inputs_embeds, position_ids=position_ids, **kwargs)

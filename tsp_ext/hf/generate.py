"""``generate`` and ``forward`` of a TSP model: Hugging Face generation with a sharded KV cache.

``apply_tsp`` binds both to the model. ``model.generate(input_ids, ...)`` takes the *full* prompt
on every rank (the same on all; left padding with its ``attention_mask`` as the tokenizer makes
it), builds a ``TSPCache``, makes every rank's sampling generator start from rank 0's state and
runs Hugging Face's own ``generate``: the logits are identical on every rank, so every rank picks
the same tokens and returns the same sequences. ``forward`` sends calls that carry a cache to
the inference path (``hf.inference``) and every other call, unchanged, to the training forward.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..engine.parallel import comm
from .cache import TSPCache
from .causal_lm import vocab_sharded_forward
from .inference import inference_forward
from .log_probs import fused_lm_head_forward
from .moe import collect_router_logits, with_aux_loss
from .replicated import bucketed_grads
from .vision import vision_forward

# generate() options that need something a TSP cache does not do (crop, re-run, a second model)
_UNSUPPORTED = {
    "assistant_model": "assisted decoding",
    "prompt_lookup_num_tokens": "prompt-lookup decoding",
    "assistant_early_exit": "self-speculative decoding",
    "penalty_alpha": "contrastive search",
    "dola_layers": "DoLa decoding",
    "custom_generate": "custom generation methods",
    "negative_prompt_ids": "classifier-free guidance",
    "guidance_scale": "classifier-free guidance",
    "inputs_embeds": "prompts given as embeddings",
    "cache_implementation": "other cache implementations",
}


def tsp_forward(
    self,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Cache | None = None,
    logits_to_keep: int = 0,
    **kwargs,
):
    """``forward`` of a TSP model. With a ``cache`` (or ``past_key_values``): prefill or decode
    (``inference_forward``). With ``fused_lm_head=True``: TRL's per-token log-probabilities
    (``hf.log_probs``). Otherwise: the training / prefill forward ``apply_tsp`` set up, called
    with exactly the arguments given."""
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    if cache is not None:
        return inference_forward(
            self, input_ids, attention_mask, position_ids, cache=cache, **kwargs
        )
    given = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    given = {k: v for k, v in given.items() if v is not None}
    if logits_to_keep:
        given["logits_to_keep"] = logits_to_keep
    train = vocab_sharded_forward if self.tsp.config.shard_vocab else type(self).forward
    if self.tsp.family.vision is not None:
        train = vision_forward
    fused = kwargs.pop("fused_lm_head", False)
    if (fused or kwargs.get("return_token_logps")) and not self.tsp.config.shard_vocab:
        raise ValueError(
            "per-token log-probabilities (fused_lm_head / return_token_logps) need the "
            "vocab-sharded LM head: TSPConfig(shard_vocab=True), the default"
        )
    if fused:
        if self.tsp.family.vision is not None:
            raise ValueError(
                "TRL's per-token log-probabilities (fused_lm_head) of a vision-language model "
                "are not supported under TSP; call the model on shard_batch's inputs with "
                "return_token_logps=True"
            )
        train = fused_lm_head_forward
    router = kwargs.pop("output_router_logits", None)
    if self.tsp.family.moe:  # the aux loss is added below, over the whole TSP group's tokens
        kwargs["output_router_logits"] = False
    with bucketed_grads(self), collect_router_logits() as logits:
        out = train(self, **given, **kwargs)
    return with_aux_loss(self, out, logits, router)


def tsp_vision_forward(
    self,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Cache | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    **kwargs,
):
    """``tsp_forward`` of a vision-language model, its multimodal inputs named (Hugging Face's
    ``generate`` passes only the inputs ``forward`` names)."""
    vision = dict(
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts,
        mm_token_type_ids=mm_token_type_ids,
    )
    given = {k: v for k, v in vision.items() if v is not None}
    return tsp_forward(
        self, input_ids, attention_mask, position_ids, cache=cache, **given, **kwargs
    )


def _check_generation_options(generation_config, kwargs: dict) -> None:
    for name, what in _UNSUPPORTED.items():
        value = kwargs.get(name, getattr(generation_config, name, None))
        if value is not None and value is not False:
            raise ValueError(f"TSP generate does not support {what} ({name}={value!r})")
    if kwargs.get("use_cache", getattr(generation_config, "use_cache", True)) is False:
        raise ValueError("TSP generate decodes from its sharded KV cache: drop use_cache=False")


def sync_sampling_state(group, device: torch.device) -> None:
    """Give every rank of ``group`` the random state of its first rank (CPU, and the current
    CUDA device's when ``device`` is CUDA), so that sampling picks the same tokens everywhere."""
    state = torch.get_rng_state()
    comm.broadcast(state, 0, group)
    torch.set_rng_state(state)
    if device.type == "cuda":
        state = torch.cuda.get_rng_state().to(device)
        comm.broadcast(state, 0, group)
        torch.cuda.set_rng_state(state.cpu())


def tsp_generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
    """Hugging Face ``generate`` on a TSP model; every rank passes the same full prompt and gets
    the same output. Greedy, sampling and beam search; options that crop or re-run the cache
    (assisted decoding, contrastive search, ...) raise ``ValueError``."""
    _check_generation_options(generation_config, kwargs)
    cache = kwargs.pop("cache", None)
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    if cache is None:
        cache = TSPCache(self)
    elif not isinstance(cache, TSPCache):
        raise ValueError(
            f"a TSP model needs a TSPCache (its KV heads are sharded), got {type(cache).__name__}"
        )
    cache.check_layout(self)
    sync_sampling_state(self.tsp.group, self.device)
    generate = type(self).generate  # the class's (Hugging Face's), not this binding
    return generate(self, inputs, generation_config, cache=cache, use_cache=True, **kwargs)

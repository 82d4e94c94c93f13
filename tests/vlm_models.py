"""Tiny vision-language models built from their config classes, and batches with images and a
video (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

IMAGE, VIDEO, START, END = 100, 101, 102, 103
TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
)
TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    max_position_embeddings=1024,
)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
ROPE = dict(rope_type="default", rope_theta=1e4)
VLMS = ("qwen2_5_vl", "qwen3_vl", "llava")
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}


def config(name: str):
    if name == "qwen2_5_vl":
        return Qwen2_5_VLConfig(
            text_config=dict(**TEXT, rope_parameters=dict(**ROPE, mrope_section=[2, 3, 3])),
            vision_config=dict(**VISION, window_size=56, fullatt_block_indexes=[1]),
            **TOKENS,
        )
    if name == "qwen3_vl":
        return Qwen3VLConfig(
            text_config=dict(
                **TEXT,
                head_dim=16,
                rope_parameters=dict(**ROPE, mrope_section=[4, 2, 2], mrope_interleaved=True),
            ),
            vision_config=dict(
                **VISION, num_position_embeddings=16, deepstack_visual_indexes=[0, 1]
            ),
            **TOKENS,
        )
    text = {k: v for k, v in TEXT.items()}
    return LlavaConfig(
        text_config=LlamaConfig(**text).to_dict(),
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ).to_dict(),
        image_token_index=IMAGE,
    )


def build_vlm(name: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """The same randomly initialised model on every rank, in ``dtype``, with non-trivial norms
    and biases."""
    cls = {
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
        "llava": LlavaForConditionalGeneration,
    }[name]
    torch.manual_seed(seed)
    cfg = config(name)
    for key, value in overrides.items():  # e.g. LLaVA's vision_feature_layer / _select_strategy
        setattr(cfg, key, value)
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "sdpa"
    model = cls(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _row(parts: list, S: int) -> tuple[list[int], int]:
    """Token ids of one row: text runs (lists) and vision blocks (``(token, n)``), padded."""
    ids = []
    for part in parts:
        ids += [START, *[part[0]] * part[1], END] if isinstance(part, tuple) else part
    return ids + [0] * (S - len(ids)), len(ids)


def vlm_batch(
    name: str, dtype: torch.dtype = torch.float64, seed: int = 1, S: int = 64, per_image: int = 4
):
    """Two rows: row 0 text, an image, text, a video (2 temporal slices; Qwen-VL), text; row 1
    text, a second image, text, right-padded. Labels are the ids, -100 on vision tokens and
    padding (as a VLM collator makes them)."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(3, 99, (n,), generator=g).tolist()  # noqa: E731
    out = {}
    if name == "llava":
        rows = [
            [text(5), (IMAGE, per_image), text(9), (IMAGE, per_image), text(6)],
            [text(7), (IMAGE, per_image), text(11)],
        ]
        out["pixel_values"] = torch.randn(3, 3, 28, 28, generator=g, dtype=dtype)
    else:
        p = PATCH[name]
        image_grid = torch.tensor([[1, 4, 4], [1, 4, 8]])
        video_grid = torch.tensor([[2, 4, 4]])
        # Qwen3-VL's processor wraps each video frame in its own start / end, after its timestamp
        video = [(VIDEO, 8)] if name == "qwen2_5_vl" else [text(2), (VIDEO, 4), text(2), (VIDEO, 4)]
        rows = [[text(5), (IMAGE, 4), text(6), *video, text(7)], [text(4), (IMAGE, 8), text(9)]]
        width = 3 * 2 * p * p
        out["pixel_values"] = torch.randn(16 + 32, width, generator=g, dtype=dtype)
        out["pixel_values_videos"] = torch.randn(32, width, generator=g, dtype=dtype)
        out["image_grid_thw"], out["video_grid_thw"] = image_grid, video_grid
    made = [_row(r, S) for r in rows]
    ids = torch.tensor([m[0] for m in made])
    mask = torch.tensor([[1] * n + [0] * (S - n) for _, n in made])
    labels = ids.masked_fill((mask == 0) | (ids == IMAGE) | (ids == VIDEO), -100)
    mm = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    out.update(input_ids=ids, attention_mask=mask, labels=labels)
    if name != "llava":
        out["mm_token_type_ids"] = mm
    return out


def first_row(name: str, batch: dict) -> dict:
    """A ``vlm_batch``'s first row with its images (and its video for Qwen-VL)."""
    keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids")
    out = {k: batch[k][:1] for k in keys if k in batch}
    if name == "llava":
        return {**out, "pixel_values": batch["pixel_values"][:2]}
    out.update(pixel_values=batch["pixel_values"][:16], image_grid_thw=batch["image_grid_thw"][:1])
    return {**out, **{k: batch[k] for k in ("pixel_values_videos", "video_grid_thw")}}


def vlm_prompt(name: str, dtype: torch.dtype = torch.float64) -> dict:
    """``vlm_batch``'s first row as a generation prompt (no padding, no labels)."""
    row = first_row(name, vlm_batch(name, dtype))
    n = int(row.pop("attention_mask").sum())
    row.pop("labels")
    cut = {k: row.pop(k)[:, :n] for k in ("input_ids", "mm_token_type_ids") if k in row}
    return {**row, **cut, "attention_mask": torch.ones(1, n, dtype=torch.long)}


def left_padded(batch: dict) -> dict:
    """``vlm_batch`` as a generation prompt: no labels, each row's padding moved to its front
    (as a tokenizer pads for generation)."""
    out = {k: v for k, v in batch.items() if k != "labels"}
    S = out["input_ids"].shape[1]
    real = out["attention_mask"].sum(1).tolist()
    order = torch.stack([torch.arange(S).roll(S - n) for n in real])
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in out:
            out[key] = out[key].gather(1, order)
    return out

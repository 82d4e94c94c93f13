"""Vision-language pieces of the recipes: an offline image-caption dataset, tiny VLM presets with
their processor, and loading a real checkpoint's model and processor.

``shapes`` is a synthetic dataset that needs nothing downloaded: each sample holds
``--images-per-sample`` pictures of a coloured shape, and its text names them in order, so the
captions can only be learnt by looking. The ``tiny-llava`` preset is a randomly initialised
LLaVA (a Llama over a CLIP tower) whose processor pairs CLIP's image preprocessing with a
byte-level BPE trained on the captions (Qwen-VL's processors need torchvision for their video
part, so the offline preset is LLaVA; a Qwen-VL checkpoint brings its own processor).
"""

from __future__ import annotations

import json
import os
import random

import torch
from PIL import Image, ImageDraw

from tsp_ext import TSPConfig, init_tsp_mesh, load_pretrained

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
}
SHAPES = ("square", "circle", "triangle")
PLACES = ("top left", "top right", "bottom left", "bottom right")
IMAGE = "<image>"  # the placeholder the processor expands to one token per image feature
# the preset's text and vision shapes (its vocabulary comes from the tokenizer)
TEXT = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
VLM_PRESETS = ("tiny-llava",)


def draw(colour: str, shape: str, place: str, size: int) -> Image.Image:
    """A ``size`` x ``size`` picture of one shape in one quarter, on a grey background."""
    image = Image.new("RGB", (size, size), (128, 128, 128))
    half = size // 2
    x0 = half if "right" in place else 0
    y0 = half if "bottom" in place else 0
    box = (x0 + size // 16, y0 + size // 16, x0 + half - size // 16, y0 + half - size // 16)
    pen = ImageDraw.Draw(image)
    if shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    else:
        pen.polygon(
            [(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])],
            fill=COLOURS[colour],
        )
    return image


def shapes(n: int, images_per_sample: int, size: int, seed: int) -> list[dict]:
    """``n`` samples ``{"images": [PIL images], "text": ...}`` (TRL's vision format): each image
    behind its placeholder, then its caption."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        images, parts = [], []
        for _ in range(images_per_sample):
            colour, shape, place = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(PLACES)
            images.append(draw(colour, shape, place, size))
            parts.append(f"{IMAGE}a {colour} {shape} in the {place}.")
        rows.append({"images": images, "text": " ".join(parts)})
    return rows


def load_image_rows(path: str) -> list[dict]:
    """A JSON-lines file of ``{"images": [paths relative to the file], "text": ...}`` rows."""
    root = os.path.dirname(os.path.abspath(path))
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        row["images"] = [Image.open(os.path.join(root, p)).convert("RGB") for p in row["images"]]
    return rows


def preset_processor(texts: list[str], vocab_size: int, path: str, size: int):
    """A LLaVA processor (CLIP's image preprocessing at ``size`` pixels a side, patches of 14)
    over a BPE of ``vocab_size`` trained on ``texts`` plus the image token, saved in ``path``
    (the caller's main process)."""
    from _data import train_tokenizer
    from transformers import LlavaProcessor

    try:  # the PIL backend where torchvision is not installed
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor

    tokenizer = train_tokenizer(texts, vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    tokenizer.pad_token = tokenizer.eos_token
    images = ImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token=IMAGE,
        num_additional_image_tokens=1,  # CLIP's class token, dropped by the "default" strategy
    )
    processor.save_pretrained(path)
    return processor


def preset_model(name: str, processor, size: int, seed: int, dtype: torch.dtype):
    """A randomly initialised ``tiny-llava`` (a Llama over a CLIP tower of ``size`` pixels)
    for ``processor``'s tokens, the same on every rank (``seed``)."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tok = processor.tokenizer
    text = LlamaConfig(
        **TEXT,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
    )
    vision = CLIPVisionConfig(**VISION, image_size=size, patch_size=14)
    cfg = LlavaConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=tok.convert_tokens_to_ids(IMAGE),
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(cfg).to(dtype)


def pretrained(path: str, tsp: TSPConfig, dtype: torch.dtype):
    """A Hugging Face vision-language checkpoint (directory or hub id) as a TSP model, each rank
    reading only its shards of the language model (``tsp_ext.load_pretrained``), and its
    processor."""
    from transformers import AutoProcessor

    model = load_pretrained(path, init_tsp_mesh(tsp.tsp_size), tsp, dtype=dtype)
    return model, AutoProcessor.from_pretrained(path)

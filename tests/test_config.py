"""TSPConfig's JSON-style options (a DeepSpeed "tsp" block) read back what they write."""

from __future__ import annotations

import json

import torch

from tsp_ext import TSPConfig


def test_to_dict_round_trips_through_json():
    cfg = TSPConfig(tsp_size=4, accum_dtype=torch.float64, overlap=False, loss_chunk=64)
    block = json.loads(json.dumps(cfg.to_dict()))
    assert block["size"] == 4 and block["accum_dtype"] == "float64"
    assert TSPConfig.from_dict(block) == cfg

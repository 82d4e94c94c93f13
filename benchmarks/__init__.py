"""Benchmarks of TSP against TP, TP+SP, Ulysses, TP×SP and ring attention on the same work.

- ``harness.measure(layout, devices, seq_len, model_cfg, ...)``: one layout, one length, one row
  of measured per-rank bytes (model state, saved activations, peak memory, communication per
  collective), step time and loss;
- ``registry``: the layouts, one entry each (builder, (tp, sp) split, process-wide, in the
  default sweep); everything that lists or splits layouts reads it;
- ``layouts``, ``dpo_layouts``: the builders, each using the real library (tsp_ext, torch DTensor
  parallel styles and context parallel, DeepSpeed Ulysses and ZeRO-3), for training and DPO;
- ``run``: the sweep CLI (``python -m benchmarks.run``) writing JSON, markdown and PNG plots;
- ``emulate``: one rank of a D-rank layout alone on the fake process group (real memory at
  full scale on one device), its data-dependent collectives filled by ``mirror``;
- ``emulate_fake``: the same rank's TSP training step under fake tensors (``emulate --fake``):
  MemTracker's per-rank peak of an 8B model at millions of tokens, in minutes of one CPU core;
- ``grpo``: GRPO through TRL's ``GRPOTrainer`` (one process, DeepSpeed ZeRO-3) against
  ``TSPGRPOTrainer``: the longest completion under one per-rank budget, rollout throughput and
  step time (``python -m benchmarks.grpo``);
- ``vision``: a tiny-width Qwen2.5-VL with a long video, one process against TSP and the
  sequence-parallel baselines (``python -m benchmarks.vision``);
- ``gpt_oss``: a tiny-width gpt-oss (attention sinks, sliding-window and full layers, MoE) on
  one long sequence, one process against TSP and the sequence-parallel baselines
  (``python -m benchmarks.gpt_oss``), and ``qwen3_next``, a tiny-width Qwen3-Next (hybrid
  linear attention) likewise (``python -m benchmarks.qwen3_next``), both run by ``model_paths``
  (one model along every path);
- ``self_check``: what ``apply_tsp``'s self-check costs per model type (seconds, the miniature's
  size) at D = 2 and 4 (``python -m benchmarks.self_check``);
- ``comm_counter``, ``report``, ``plots``, ``baseline_rows``: the pieces they share.
"""

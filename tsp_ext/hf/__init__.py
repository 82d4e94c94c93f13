"""Hugging Face integration: TSP modules replacing the decoder's, ``apply_tsp``, batches.

- ``sharding``: the sharded-module protocol (local slices of full HF tensors, parameter roles)
- ``families``: one spec per model family: where it keeps its parts, each layer's kinds of token
  and channel mixer, its flags and weight names, its ``model_type`` s (torch-free: the planner
  reads it too)
- ``spec``: the vocabulary of those specs (``Family``, ``TokenMixer``, ``ChannelMixer``, ...)
- ``layers``: which TSP module replaces each kind of mixer, and the check of a layer's modules
- ``attention``, ``mlp``, ``moe``, ``vocab``, ``replicated``: the TSP modules
- ``linear_attention``: Gated DeltaNet (Qwen3-Next, Qwen3.5) on its head group, its cache layer
- ``lora``, ``nf4``: PEFT LoRA adapters on TSP modules; QLoRA's 4-bit frozen base
- ``apply``: ``apply_tsp`` (module replacement) and ``check_supported``
- ``miniature``, ``self_check``: a small model of a config's own class and flags; ``apply_tsp``'s
  proof on it that the fold computes what the original computes
- ``causal_lm``: the global loss, the vocab-sharded ``forward`` and the input check
- ``log_probs``: per-token log-probabilities without full logits (preference training)
- ``checkpointing``: decoder layers recomputed in backward, their inputs offloaded (``HostStore``)
- ``batch``: ``shard_batch`` / ``gather_sequence``
- ``full_state``: full tensors under the Hugging Face names (export, compare, debug)
- ``adapter_save``: a TSP PEFT model's ``save_pretrained``: its LoRA adapter in PEFT's format
- ``cache``, ``inference``, ``generate``: the sharded KV cache, prefill / decode, ``generate``
- ``vision_plan``, ``vision``: vision-language models: which rank encodes which images and where
  their features go; the split encoder, the feature exchange and the VLM forward
"""

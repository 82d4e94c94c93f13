"""Named tiny shapes the recipes build from a config (nothing to download)."""

# config fields (a LlamaConfig's, unless ``model_type`` names another); the vocabulary size
# comes from the data's tokenizer
PRESETS = {
    "tiny-llama": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small-llama": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    # a Qwen3-MoE: 8 experts of F = 128, top-2, every layer sparse (docs/moe.md)
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    ),
}

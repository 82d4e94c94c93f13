"""Named tiny Llama shapes the recipes build from a config (nothing to download)."""

# LlamaConfig fields; the vocabulary size comes from the data's tokenizer
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
}

"""What the layer-stack tests share: the small Llama's sizes (its layer count is each test's own)."""

SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=32,
)

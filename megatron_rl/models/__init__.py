"""Model builders (HF config -> Megatron), value head, sharding helpers."""

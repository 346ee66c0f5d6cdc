"""megatron_rl: GRPO, PPO and SAO for language models on Megatron-core."""

__version__ = "0.1.0"

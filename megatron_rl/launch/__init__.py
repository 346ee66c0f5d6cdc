"""Launchers and the `megatron-rl` command line."""

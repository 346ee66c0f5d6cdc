"""Shared training machinery (policy and critic): optimizer, packed micro-batch steps over a
received grid with global token normalisation (the roles bring their losses: policy/loss.py,
critic/loss.py), checkpoints."""

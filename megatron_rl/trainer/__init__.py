"""Shared training machinery (policy and critic): optimizer, packed micro-batch steps over a
received grid with global token normalisation, checkpoints."""

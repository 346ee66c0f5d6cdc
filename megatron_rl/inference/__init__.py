"""Inference side: the vLLM worker extension that receives broadcast weights (path (b))."""

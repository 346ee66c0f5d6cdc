"""Helpers for tests against real vLLM servers: perturbed copies of a tiny HF model (new weights
to publish) and transformers' per-token log-probabilities (the reference vLLM is compared with)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def perturbed_weights(model_dir: Path, out: Path, seed: int, scale: float = 0.05) -> Path:
    """A copy of the HF model at `model_dir` with every weight moved by seeded noise."""

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    model.save_pretrained(out)
    return out


def hf_token_logprobs(
    model_dir, tokens: list[int], start: int, state: dict | None = None, temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """transformers' log-probability of tokens[i] given tokens[:i] under softmax(logits /
    temperature), for i >= start; the model (and `state`) in `dtype`."""

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    if state is not None:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not [k for k in missing if "rotary" not in k]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double() / temperature, -1)
    return [logprobs[i - 1, tokens[i]].item() for i in range(start, len(tokens))]

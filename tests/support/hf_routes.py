"""The routes of a Qwen3-MoE sampler, from transformers alone (never from megatron_rl code): the
reference routing-replay tests compare the trainer against.

`RoutedSampler(directory, perturb, seed)` loads the HF model (float32, eval) and replaces each
layer's router (`mlp.gate`) with one that chooses its top-k experts from the logits of a
perturbed copy of the router weights (`perturb`: the noise's standard deviation relative to the
weights'; 0: the router itself), while the chosen experts' weights still come from the
unperturbed router, renormalised as the model does. So the sampler is the unperturbed network
with its routes forced to the perturbed router's choice, which is what a trainer replaying those
routes computes. `forward(token_ids)` returns (logits [T, vocab], routes [T, layers, k] uint8:
the experts every token went to in every layer); `own_routes()` then gives the unperturbed
router's own top-k on the same hidden states.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class RoutedSampler:
    def __init__(self, directory, perturb: float = 0.0, seed: int = 0):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
        config = self.model.config
        self.topk, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        generator = torch.Generator().manual_seed(seed)
        self.chosen: list[torch.Tensor | None] = []  # per layer: the experts the sampler took
        self.own: list[torch.Tensor | None] = []  # per layer: the unperturbed router's top-k
        for index, layer in enumerate(self.model.model.layers):
            gate = layer.mlp.gate
            noise = torch.randn(gate.weight.shape, generator=generator) * gate.weight.std() * perturb
            self.chosen.append(None)
            self.own.append(None)
            gate.forward = self._router(gate, gate.weight.detach() + noise, index)

    def _router(self, gate, choosing_weight: torch.Tensor, index: int):
        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden_states, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            choosing = torch.softmax(F.linear(hidden_states, choosing_weight), dtype=torch.float, dim=-1)
            indices = torch.topk(choosing, self.topk, dim=-1).indices
            values = probs.gather(1, indices)
            if self.norm_topk_prob:
                values = values / values.sum(dim=-1, keepdim=True)
            self.chosen[index] = indices
            self.own[index] = torch.topk(probs, self.topk, dim=-1).indices
            return logits, values.to(logits.dtype), indices

        return forward

    @torch.no_grad()
    def forward(self, token_ids) -> tuple[torch.Tensor, np.ndarray]:
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None]
        logits = self.model(ids).logits[0]
        routes = torch.stack(self.chosen, dim=1)  # [T, layers, k]
        return logits, routes.numpy().astype(np.uint8)

    def own_routes(self) -> np.ndarray:
        """[T, layers, k] uint8: the unperturbed router's top-k in the last `forward`."""
        return torch.stack(self.own, dim=1).numpy().astype(np.uint8)

    def logprobs(self, token_ids) -> tuple[np.ndarray, np.ndarray]:
        """(log-probability of each token given the ones before it [T] (0 for the first), routes)."""
        logits, routes = self.forward(token_ids)
        log_p = torch.log_softmax(logits, dim=-1)
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
        out = np.zeros(len(ids), dtype=np.float32)
        out[1:] = log_p[:-1].gather(1, ids[1:, None])[:, 0].numpy()
        return out, routes

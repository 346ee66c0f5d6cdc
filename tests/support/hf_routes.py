"""The routes of a Qwen3-MoE, GLM-4.5-style (glm4_moe) or DeepSeek-V3-style (deepseek_v3) sampler, from transformers alone (never
from megatron_rl code): the reference routing-replay tests compare the trainer against.

`RoutedSampler(directory, perturb, seed)` loads the HF model (float32, eval) and replaces each
MoE layer's router (`mlp.gate`) with one that chooses its top-k experts from a perturbed copy of
the router (`perturb`: the noise's standard deviation relative to the weights'; 0: the router
itself), while the chosen experts' weights still come from the unperturbed router, renormalised
(and scaled) as the model does. Qwen3-MoE's router chooses by softmax; glm4_moe's by sigmoid
scores plus its expert bias (`e_score_correction_bias`, perturbed too), within the topk_group
groups scored by their top-2 (transformers' Glm4MoeTopkRouter, written out here; deepseek_v3's
DeepseekV3TopkRouter is the same rule with the same attribute names). So the sampler
is the unperturbed network with its routes forced to the perturbed router's choice, which is
what a trainer replaying those routes computes. `forward(token_ids)` returns (logits [T, vocab],
routes [T, layers, k] uint8: the experts every token went to in every layer, zeros in a dense
layer as vLLM's capture buffer leaves them); `own_routes()` then gives the unperturbed router's
own top-k on the same hidden states.
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
        self.sigmoid = config.model_type in ("glm4_moe", "deepseek_v3")
        generator = torch.Generator().manual_seed(seed)
        self.chosen: list[torch.Tensor | None] = []  # per layer: the experts the sampler took
        self.own: list[torch.Tensor | None] = []  # per layer: the unperturbed router's top-k
        self.moe_layers: list[int] = []
        for index, layer in enumerate(self.model.model.layers):
            self.chosen.append(None)
            self.own.append(None)
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "weight") or gate.weight.dim() != 2:
                continue  # a dense layer (glm4_moe's first_k_dense_replace)
            self.moe_layers.append(index)
            noise = torch.randn(gate.weight.shape, generator=generator) * gate.weight.std() * perturb
            bias = None
            if self.sigmoid:
                bias = gate.e_score_correction_bias.detach()
                bias = bias + torch.randn(bias.shape, generator=generator) * bias.std() * perturb
            gate.forward = self._router(gate, gate.weight.detach() + noise, bias, index)

    def _choose(self, gate, logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The top-k experts [tokens, k] the router's rule picks from router logits."""
        if not self.sigmoid:
            return torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.topk, dim=-1).indices
        scores = logits.sigmoid() + bias
        grouped = scores.view(-1, gate.num_group, gate.num_experts // gate.num_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=gate.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        keep = keep[:, :, None].expand_as(grouped).reshape(scores.shape)
        return torch.topk(scores.masked_fill(~keep, float("-inf")), self.topk, dim=-1).indices

    def _router(self, gate, choosing_weight: torch.Tensor, choosing_bias: torch.Tensor | None, index: int):
        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, gate.weight.shape[1]).float()
            logits = F.linear(hidden_states, gate.weight)
            own_bias = gate.e_score_correction_bias if self.sigmoid else None
            indices = self._choose(gate, F.linear(hidden_states, choosing_weight), choosing_bias)
            probs = logits.sigmoid() if self.sigmoid else torch.softmax(logits, dtype=torch.float, dim=-1)
            values = probs.gather(1, indices)
            if self.norm_topk_prob:
                values = values / (values.sum(dim=-1, keepdim=True) + (1e-20 if self.sigmoid else 0.0))
            if self.sigmoid:
                values = values * gate.routed_scaling_factor
            self.chosen[index] = indices
            self.own[index] = self._choose(gate, logits, own_bias)
            return logits, values.to(logits.dtype), indices

        return forward

    def _stack(self, per_layer: list[torch.Tensor | None]) -> np.ndarray:
        tokens = per_layer[self.moe_layers[0]].shape[0]
        zeros = torch.zeros(tokens, self.topk, dtype=torch.long)
        return torch.stack([zeros if t is None else t for t in per_layer], dim=1).numpy().astype(np.uint8)

    @torch.no_grad()
    def forward(self, token_ids) -> tuple[torch.Tensor, np.ndarray]:
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None]
        logits = self.model(ids).logits[0]
        return logits, self._stack(self.chosen)  # [T, layers, k]

    def own_routes(self) -> np.ndarray:
        """[T, layers, k] uint8: the unperturbed router's top-k in the last `forward`."""
        return self._stack(self.own)

    def logprobs(self, token_ids) -> tuple[np.ndarray, np.ndarray]:
        """(log-probability of each token given the ones before it [T] (0 for the first), routes)."""
        logits, routes = self.forward(token_ids)
        log_p = torch.log_softmax(logits, dim=-1)
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
        out = np.zeros(len(ids), dtype=np.float32)
        out[1:] = log_p[:-1].gather(1, ids[1:, None])[:, 0].numpy()
        return out, routes

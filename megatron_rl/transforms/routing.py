"""Routing replay (R3) and router health for a mixture-of-experts policy.

The sampler (vLLM) and the trainer route some tokens to different experts (other kernels, batch
shapes, precision), so without help the trainer computes the log-probabilities of a different
network than the one that sampled. With `algorithm.routing_replay: replay` every MoE layer of
the policy takes, for every token, the experts vLLM chose (`routes`: [tokens, moe_layers, top_k]
expert indices, sent with the samples); with `measure` it keeps its own choice and only counts
how often it agrees with vLLM's.

Only the choice is replayed. The weights of the chosen experts are still the trainer's router's
(its softmax over the router logits, gathered at the replayed experts, renormalised as the model
renormalises its own top-k), so the router keeps its gradient: the same as megatron-core's
RouterReplay, verl, slime and NeMo-RL do.

`attach_routing(model, mode, num_layers, topk)` gives each MoE layer of one model its own
replay object (a `RouterReplay`, megatron's hook in `topk_routing_with_score_function`; not
registered in megatron's process-wide list, so a KL reference model or a rebuilt model cannot
take or corrupt the policy's routes). Per micro-batch, `ModelRouting.set_batch` gives this rank's
tokens their routes: the CP slice is the batch's (trainer/batches.py), the sequence-parallel
slice over TP and the pipeline stage's layers are taken here. A pass over several micro-batches
runs inside `ModelRouting.forward_pass(training)`:

- a layer's forward replays the routes of the current micro-batch;
- in a training pass, a forward without gradients is a checkpointed one (megatron's activation
  recomputation runs the first forward under no_grad): its routes are queued, and the layer's
  recomputation in the backward (inside the autograd engine) takes them from that queue, in
  micro-batch order (every schedule backpropagates micro-batches in the order it ran them);
- a forward-only pass queues nothing, and every pass leaves nothing behind (a training pass
  whose queues are not drained is an error).

Router health: while `measuring`, every forward of a layer also computes the trainer's own top-k
and counts, over the tokens vLLM routed, the (token, layer, k) choices that agree (as sets per
token and layer) and the tokens that differ in at least one layer (over every pipeline stage's
layers). `statistics()` reduces them over all ranks.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_rl.parallel import collective_device
from megatron_rl.transforms.base import ModelTransform

ROUTING_MODES = ("off", "measure", "replay")


class LayerRoutes(RouterReplay):
    """One MoE layer's replay state, owned by its model's `ModelRouting`."""

    def __init__(self, owner: ModelRouting, layer: int):
        # Not RouterReplay.__init__: it appends to megatron's class-level list of every router in
        # the process (the reference model's too); this object belongs to one model.
        self.owner, self.layer = owner, layer
        self.target: torch.Tensor | None = None  # [tokens, k] int64: this micro-batch's routes
        self.recompute: deque[torch.Tensor] = deque()  # routes of checkpointed forwards, in order
        self.router_replay_action = None
        self.target_topk_idx = self.recorded_topk_idx = None
        self.replay_backward_list = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return self.owner.choose(self, scores, topk, num_groups, group_topk, default_compute_topk)


def _in_backward() -> bool:
    """Whether this runs inside the autograd engine (a checkpointed layer's recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ModelRouting:
    """The routing replay and router statistics of one model's local MoE layers."""

    def __init__(self, model: torch.nn.Module, mode: str, num_layers: int, topk: int):
        if mode not in ("measure", "replay"):
            raise ValueError(f"routing replay mode {mode!r}: expected 'measure' or 'replay'")
        config = model.config
        if config.moe_router_fusion:
            raise ValueError(
                "routing replay needs megatron's unfused router (moe_router_fusion off): the fused "
                "top-k kernel bypasses RouterReplay"
            )
        self.mode, self.num_layers, self.topk = mode, num_layers, topk
        self.layers: list[LayerRoutes] = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if module.layer_number is None:
                    raise ValueError("routing replay: a MoE router without a layer number")
                module.router_replay = LayerRoutes(self, module.layer_number - 1)
                self.layers.append(module.router_replay)
        if not self.layers and parallel_state.is_pipeline_first_stage() and parallel_state.is_pipeline_last_stage():
            raise ValueError("routing replay: the model has no MoE layer (a dense policy has no routes)")
        self.sequence_parallel = bool(config.sequence_parallel)
        self.active = False
        self.training = False
        self.measuring = False
        self.routed: torch.Tensor | None = None  # [tokens] bool: this micro-batch's tokens vLLM routed
        self._reset_statistics()

    # -- per pass and micro-batch ---------------------------------------------------------------

    @contextmanager
    def forward_pass(self, training: bool):
        """Around one forward(-backward) schedule over a list of micro-batches."""
        self._clear()
        self.active, self.training = True, training
        try:
            yield self
            if training and any(layer.recompute for layer in self.layers):
                left = {layer.layer: len(layer.recompute) for layer in self.layers if layer.recompute}
                raise RuntimeError(
                    f"routing replay: checkpointed MoE layers were not recomputed in the backward "
                    f"(routes left per layer: {left})"
                )
        finally:
            self.active = False
            self._clear()

    def _clear(self) -> None:
        for layer in self.layers:
            layer.target = None
            layer.recompute.clear()
        self.routed = None

    def set_batch(self, batch) -> None:
        """This micro-batch's routes on this rank: the batch's `routes` [n, num_layers, k] for the
        n tokens of its CP slice and `routed` [n] bool (the tokens vLLM routed). None (a dummy
        micro-batch, or a grid without routes): padding routes everywhere, nothing measured."""
        routes, routed = getattr(batch, "routes", None), getattr(batch, "routed", None)
        if routes is not None:
            if routes.dim() != 3 or routes.shape[1:] != (self.num_layers, self.topk):
                raise ValueError(
                    f"routing replay: routes of shape {tuple(routes.shape)}; the policy has "
                    f"{self.num_layers} MoE layers of top-{self.topk}"
                )
            if self.sequence_parallel:  # the MoE layer sees this TP rank's chunk of the sequence
                tp = parallel_state.get_tensor_model_parallel_world_size()
                rank = parallel_state.get_tensor_model_parallel_rank()
                chunk = routes.shape[0] // tp
                routes, routed = routes[rank * chunk : (rank + 1) * chunk], routed[rank * chunk : (rank + 1) * chunk]
        self.routed = routed if routes is not None else None
        for layer in self.layers:  # int64 per layer (the gather's index), compact until here
            layer.target = None if routes is None else routes[:, layer.layer].to(torch.long)
        if self.measuring and routes is not None:
            self._differs.append(torch.zeros(routes.shape[0], dtype=torch.bool, device=routes.device))
            self._routed.append(routed)

    # -- the router's hook ----------------------------------------------------------------------

    def choose(self, layer: LayerRoutes, scores, topk, num_groups, group_topk, default):
        """The (probabilities, experts) of a router call: replayed, or its own top-k."""
        if not self.active:
            return default(scores, topk, num_groups, group_topk)
        if _in_backward():
            if self.mode == "measure":
                return default(scores, topk, num_groups, group_topk)
            if not layer.recompute:
                raise RuntimeError(f"routing replay: MoE layer {layer.layer} recomputed without queued routes")
            routes = layer.recompute.popleft()
        else:
            routes = layer.target
            if routes is None:
                # A dummy micro-batch: padding routes (experts 0..k-1, as data/types.py pads).
                routes = torch.arange(topk, device=scores.device).expand(scores.shape[0], topk)
            elif routes.shape[0] != scores.shape[0]:
                raise RuntimeError(
                    f"routing replay: MoE layer {layer.layer} routes {scores.shape[0]} tokens but was given "
                    f"routes for {routes.shape[0]}"
                )
            own = None
            if self.measuring and layer.target is not None:
                own = default(scores, topk, num_groups, group_topk)
                self._count(layer, own[1], routes)
            if self.mode == "measure":
                return own if own is not None else default(scores, topk, num_groups, group_topk)
            if self.training and not torch.is_grad_enabled():  # checkpointed: recomputed in the backward
                layer.recompute.append(routes)
        routes = routes.to(scores.device)
        return scores.gather(1, routes), routes

    # -- router health ----------------------------------------------------------------------------

    def _reset_statistics(self) -> None:
        # Counted on the model's device (no host sync per layer), reduced in `statistics`.
        self._agree = torch.zeros(self.num_layers, dtype=torch.float64, device=collective_device())
        self._choices = torch.zeros_like(self._agree)
        self._differs: list[torch.Tensor] = []
        self._routed: list[torch.Tensor] = []

    def _count(self, layer: LayerRoutes, own: torch.Tensor, routes: torch.Tensor) -> None:
        with torch.no_grad():
            routed = self.routed
            agree = (own[:, :, None] == routes[:, None, :]).any(-1).sum(-1)  # [tokens] in 0..k
            self._agree[layer.layer] += agree[routed].sum().to(self._agree)
            self._choices[layer.layer] += routed.sum().to(self._agree) * self.topk
            self._differs[-1] |= agree < self.topk

    @contextmanager
    def measure(self):
        """Counts router agreement in the forwards run inside."""
        self.measuring = True
        try:
            yield
        finally:
            self.measuring = False

    def statistics(self) -> dict:
        """Router health since the last call, summed over every rank of the role (each (token,
        layer) is routed on exactly one rank: DP, CP and sequence parallel split the tokens,
        PP the layers), then reset: `router_agreement` (the fraction of (token, layer, k)
        choices where the trainer's router agrees with vLLM's), `router_token_mismatch` (the
        fraction of routed tokens that differ in at least one layer), `router_tokens`, and
        `router_agreement_layer` (per layer)."""
        device = collective_device()
        differs = torch.cat(self._differs).to(device) if self._differs else torch.zeros(0, dtype=torch.bool, device=device)
        routed = torch.cat(self._routed).to(device) if self._routed else torch.zeros(0, dtype=torch.bool, device=device)
        first = True
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # A token differs when it differs on any stage (every stage ran the same micro-batches).
            flags = differs.to(torch.uint8)
            torch.distributed.all_reduce(
                flags, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_pipeline_model_parallel_group()
            )
            differs, first = flags.bool(), parallel_state.is_pipeline_first_stage()
        token_counts = torch.stack([(differs & routed).sum(), routed.sum()]).to(torch.float64) * float(first)
        totals = torch.cat([self._agree, self._choices, token_counts])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        totals = totals.cpu()
        self._reset_statistics()
        agree, choices = totals[: self.num_layers], totals[self.num_layers : 2 * self.num_layers]
        differing, tokens = float(totals[-2]), float(totals[-1])
        return {
            "router_agreement": float(agree.sum() / choices.sum()) if choices.sum() else None,
            "router_token_mismatch": differing / tokens if tokens else None,
            "router_tokens": int(tokens),
            "router_agreement_layer": [float(a / c) if c else None for a, c in zip(agree, choices)],
        }


def attach_routing(model: torch.nn.Module, mode: str, num_layers: int, topk: int) -> ModelRouting | None:
    """Gives `model`'s MoE layers routing replay in `mode` ("off": nothing, returns None). The
    returned `ModelRouting` is the hook a pass over the model is given (trainer/forward.py
    `forward_only(..., hooks=)`, `Trainable.hooks`): a pass without it routes by the model's own
    router (a LoRA policy's KL reference, the policy's own model with its adapters off)."""
    if mode == "off":
        return None
    return ModelRouting(model, mode, num_layers, topk)


class RoutingReplay(ModelTransform):
    """`algorithm.routing_replay` (measure or replay) as a model transform: `apply` attaches a
    `ModelRouting` to the built model, whose every training and pi_old pass it then takes part in
    (`pass_hook`)."""

    name = "routing_replay"

    def __init__(self, mode: str, num_layers: int, topk: int):
        self.mode, self.num_layers, self.topk = mode, num_layers, topk
        self.routing: ModelRouting | None = None

    def apply(self, model: torch.nn.Module) -> str:
        self.routing = attach_routing(model, self.mode, self.num_layers, self.topk)
        return f"routing replay: {self.mode} on {len(self.routing.layers)} local MoE layers"

    def pass_hook(self) -> ModelRouting | None:
        return self.routing

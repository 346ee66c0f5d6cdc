"""Routing replay (transforms/routing.py) on a tiny Qwen3-MoE and a tiny GLM-4.5-style model
(glm4_moe: sigmoid router with an expert bias and group-limited top-k, a dense first layer),
against transformers; a tiny DeepSeek-V3-style model (deepseek_v3: the same router behind
multi-latent attention) in the replay-and-measure test.

The sampler is transformers' model whose routers choose their experts from a perturbed copy
of the router weights (and glm4_moe's expert bias; tests/support/hf_routes.py): its routes are what vLLM would return and its
log-probabilities are those of the unperturbed network with those routes forced. The trainer is
the unperturbed network in megatron, on the policy trainer's own path (packing with routes, the
policy batch, the forward-only log-probs):

- with the unperturbed sampler, the trainer's router agrees with every route (float32: exactly);
- with the perturbed one, replay gives the sampler's log-probs (ratio 1) and the router's
  agreement with the sampler equals transformers' own count; without replay (`measure`) the
  log-probs are measurably off (the negative control) and the measured agreement is the
  perturbation's, counted by transformers;
- the padding's routes do not change any real token's log-prob;
- TP = 2 with sequence parallel, EP = 2, CP = 2 and PP = 2 give what one process gives (glm4_moe:
  EP = 2);
- a policy update with `old_logprobs: recompute`, two mini-batches and a KL reference gives the
  same weights with full activation recomputation as without (the recomputation in the backward
  replays the same routes), and megatron's process-wide replay list stays empty; after the
  update every token still goes to exactly the experts it replays, and glm4_moe's expert bias is
  bit for bit the loaded one (moe_router_bias_update_rate 0; at a nonzero rate megatron moves it:
  the control);
- the fused router (TransformerEngine's, which bypasses RouterReplay) is off in our models, and
  replay refuses a model built with it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import hf_to_megatron
from megatron_rl.data.types import TrainingSample
from tests.support.hf_routes import RoutedSampler
from tests.support.spawn import run_ranks

LENGTHS = (9, 23, 2, 14, 31, 6, 17, 12)
SEQ_LEN = 40
PERTURB = 0.5


def _sampled(directory, perturb: float, seed: int = 7):
    """Samples (prompt of 3, then actions) with the perturbed sampler's routes (the last token
    has none, as from vLLM) and log-probs; the unperturbed router's top-k on the sampler's
    states; the unperturbed network's own routes."""
    sampler, plain = RoutedSampler(directory, perturb, seed=1), RoutedSampler(directory, 0.0)
    vocab = sampler.model.config.vocab_size
    rng = np.random.default_rng(seed)
    samples, own_on_sampler, own_network = [], [], []
    for index, length in enumerate(LENGTHS):
        tokens = rng.integers(0, vocab, length)
        mask = np.zeros(length, dtype=bool)
        mask[min(3, length - 1):] = True
        logprobs, routes = sampler.logprobs(tokens)
        own_on_sampler.append(sampler.own_routes()[: length - 1])
        own_network.append(plain.forward(tokens)[1][: length - 1])
        samples.append(TrainingSample(token_ids=tokens, loss_mask=mask, inference_logprobs=np.where(mask, logprobs, 0.0),
                                      reward=0.0, group_id=index, routes=routes[: length - 1],
                                      advantages=np.where(mask, rng.normal(size=length), 0.0).astype(np.float32)))  # fmt: skip
    return samples, own_on_sampler, own_network


def _agreement(routes: list[np.ndarray], own: list[np.ndarray], layers: list[int]) -> tuple[float, float, int]:
    """(fraction of (token, layer, k) choices in both, fraction of tokens differing in a layer,
    tokens) over the MoE `layers`, counted in numpy."""
    agree = choices = differing = tokens = 0
    for r, o in zip(routes, own):
        r, o = r[:, layers], o[:, layers]
        same = (o[:, :, :, None] == r[:, :, None, :]).any(-1).sum(-1)  # [T, layers]
        agree += int(same.sum())
        choices += same.size * r.shape[-1]
        differing += int((same < r.shape[-1]).any(-1).sum())
        tokens += len(r)
    return agree / choices, differing / tokens, tokens


FAMILIES = ["qwen3_moe", "glm4_moe"]
# deepseek_v3 routes as glm4_moe (transformers' DeepseekV3TopkRouter is Glm4MoeTopkRouter's rule); its
# multi-latent attention only changes the hidden states the router sees: replay and measure once
REPLAY_FAMILIES = [*FAMILIES, "deepseek_v3"]


@pytest.fixture(scope="module")
def moe(tiny_models, request):
    directory = tiny_models[request.param]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    return directory, arch, full


@pytest.fixture(scope="module")
def perturbed(moe):
    return _sampled(moe[0], PERTURB)


def _expected_logprobs(samples):
    return {(i, q): float(s.inference_logprobs[q]) for i, s in enumerate(samples) for q in np.flatnonzero(s.loss_mask)}


@pytest.mark.parametrize("moe", FAMILIES, indirect=True)
def test_the_trainers_router_agrees_with_an_unperturbed_sampler_on_every_route(moe):
    directory, arch, full = moe
    samples, own_on_sampler, _ = _sampled(directory, 0.0)
    assert all(np.array_equal(s.routes, o) for s, o in zip(samples, own_on_sampler))
    for mode in ("measure", "replay"):
        logprobs, stats, _ = run_ranks(replayed_logprobs, 1, arch, full, samples, mode)[0]
        assert stats["router_agreement"] == 1.0 and stats["router_token_mismatch"] == 0.0
        # a dense layer (glm4_moe's first) has no router: nothing counted there
        assert stats["router_agreement_layer"] == [1.0 if i in arch.moe_layers else None for i in range(arch.num_layers)]
        assert stats["router_tokens"] == sum(n - 1 for n in LENGTHS)
        for key, value in _expected_logprobs(samples).items():
            assert logprobs[key] == pytest.approx(value, abs=2e-5), (mode, key)


@pytest.mark.parametrize("moe", REPLAY_FAMILIES, indirect=True)
def test_replay_gives_the_samplers_logprobs_and_measure_the_perturbation(moe, perturbed):
    directory, arch, full = moe
    samples, own_on_sampler, own_network = perturbed
    routes = [s.routes for s in samples]
    replay_agreement, replay_mismatch, tokens = _agreement(routes, own_on_sampler, arch.moe_layers)
    measure_agreement, measure_mismatch, _ = _agreement(routes, own_network, arch.moe_layers)
    assert 0.5 < measure_agreement < 0.95 and measure_mismatch > 0.1  # the perturbation moved routes
    expected = _expected_logprobs(samples)

    replayed, stats, padded = run_ranks(replayed_logprobs, 1, arch, full, samples, "replay", 1, 1, 1, 1, 5)[0]
    for key, value in expected.items():
        assert replayed[key] == pytest.approx(value, abs=2e-5), key
        assert padded[key] == replayed[key], key  # other padding routes: the same real log-probs
    assert stats["router_agreement"] == pytest.approx(replay_agreement, abs=1e-12)
    assert stats["router_token_mismatch"] == pytest.approx(replay_mismatch, abs=1e-12)
    assert stats["router_tokens"] == tokens

    measured, stats, _ = run_ranks(replayed_logprobs, 1, arch, full, samples, "measure")[0]
    errors = np.array([abs(measured[key] - value) for key, value in expected.items()])
    assert errors.max() > 1e-2  # without replay the trainer computes another network
    assert stats["router_agreement"] == pytest.approx(measure_agreement, abs=1e-12)
    assert stats["router_token_mismatch"] == pytest.approx(measure_mismatch, abs=1e-12)


@pytest.mark.parametrize(
    "moe,tp,cp,pp,ep",
    [("qwen3_moe", 2, 1, 1, 1), ("qwen3_moe", 1, 1, 1, 2), ("qwen3_moe", 1, 2, 1, 1), ("qwen3_moe", 1, 1, 2, 1),
     ("glm4_moe", 1, 1, 1, 2)],
    indirect=["moe"],
)  # fmt: skip
def test_replay_at_tp2_sp_ep2_cp2_pp2_equals_one_process(moe, perturbed, tp, cp, pp, ep):
    directory, arch, full = moe
    samples = perturbed[0]
    single, single_stats, _ = run_ranks(replayed_logprobs, 1, arch, full, samples, "replay")[0]
    results = run_ranks(replayed_logprobs, tp * cp * pp * ep, arch, full, samples, "replay", tp, cp, pp, ep)
    logprobs, stats, _ = results[-1]  # the last pipeline stage holds the log-probs
    assert set(logprobs) == set(single)
    for key, value in single.items():
        assert logprobs[key] == pytest.approx(value, abs=1e-5), key
    for _, rank_stats, _ in results:
        assert rank_stats["router_tokens"] == single_stats["router_tokens"]
        assert rank_stats["router_agreement"] == pytest.approx(single_stats["router_agreement"], abs=1e-12)
        assert rank_stats["router_token_mismatch"] == pytest.approx(single_stats["router_token_mismatch"], abs=1e-12)
        assert rank_stats["router_agreement_layer"] == pytest.approx(single_stats["router_agreement_layer"], abs=1e-12)


@pytest.mark.parametrize("moe", FAMILIES, indirect=True)
def test_recomputation_in_the_backward_replays_the_same_routes(moe, perturbed):
    directory, arch, full = moe
    samples = perturbed[0]
    plain, plain_weights, plain_list = run_ranks(replayed_update, 1, arch, full, samples, "none")[0]
    recomputed, weights, recomputed_list = run_ranks(replayed_update, 1, arch, full, samples, "full")[0]
    # after the step every token goes to exactly the experts it replays (bias and groups aside)
    assert plain["experts_used_are_the_replayed"] == recomputed["experts_used_are_the_replayed"] == len(arch.moe_layers)
    assert plain["optimizer_steps"] == recomputed["optimizer_steps"] == 2
    assert plain["kl_ref"] > 0 and plain["router_agreement"] < 1.0
    assert plain["ratio_mean_first"] == pytest.approx(1.0, abs=1e-6)  # pi_old recomputed with replay
    assert plain["mismatch_kl"] < 1e-9  # replay: the trainer's pi_old is the sampler's network
    assert plain_list == recomputed_list == 0  # megatron's process-wide list of routers stays empty
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=1e-5, msg=name)
    moved = max(float((plain_weights[n] - full[n]).abs().max()) for n in full if n in plain_weights)
    assert moved > 1e-4
    biases = [n for n in full if n.endswith("router.expert_bias")]
    assert len(biases) == (len(arch.moe_layers) if arch.moe_expert_bias else 0)
    for name in biases:  # frozen: vLLM serves the bias it loaded
        assert full[name].abs().min() > 0 and torch.equal(plain_weights[name], full[name]), name
        assert torch.equal(weights[name], full[name]), name
    if biases:  # the control: megatron's aux-loss-free balancing at a nonzero rate moves it
        _, balanced, _ = run_ranks(replayed_update, 1, arch, full, samples, "none", 1e-3)[0]
        assert all(not torch.equal(balanced[name], full[name]) for name in biases)


@pytest.mark.parametrize("moe", ["qwen3_moe"], indirect=True)
def test_the_fused_router_which_bypasses_replay_stays_off(moe):
    _, arch, _ = moe
    default, refusal = run_ranks(fused_router, 1, arch)[0]
    assert default is False
    assert "routing replay needs megatron's unfused router (moe_router_fusion off)" in refusal


# Rank functions: module-level, so that the spawned ranks can import them.


def fused_router(rank, world_size, arch):
    """(moe_router_fusion of a model our builder makes, the refusal of replay on a fused one)."""
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.transforms.routing import attach_routing

    parallel.initialize_model_parallel()
    default = build_gpt_model(arch).config.moe_router_fusion
    try:
        attach_routing(build_gpt_model(arch, moe_router_fusion=True), "replay", arch.num_layers, arch.num_experts_per_tok)
    except ValueError as exc:
        return default, str(exc)
    return default, ""


def _gather(tensor: torch.Tensor, group) -> torch.Tensor:
    chunks = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(chunks, tensor.contiguous(), group=group)
    return torch.cat(chunks)


def replayed_logprobs(rank, world_size, arch, full, samples, mode, tp=1, cp=1, pp=1, ep=1, padding_seed=None):
    """The policy trainer's forward-only log-probs (policy_batch -> forward_logprobs) of every
    action token with routing `mode`, {(sample, position): logprob}, gathered over CP and DP; the
    router statistics; with `padding_seed`, the log-probs again with other padding routes."""
    from megatron.core import parallel_state as ps

    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.policy.loss import forward_logprobs, policy_batch
    from megatron_rl.transforms.routing import attach_routing

    parallel.initialize_model_parallel(tp=tp, cp=cp, pp=pp, ep=ep)
    model = build_gpt_model(arch, tp=tp, cp=cp, pp=pp, ep=ep)
    load_full_state_dict(model, full)
    model.eval()
    routing = attach_routing(model, mode, arch.num_layers, arch.num_experts_per_tok)
    sp = tp if model.config.sequence_parallel else 1
    grid = pack_into_grid(samples, SEQ_LEN, ps.get_data_parallel_world_size(), cp, sequence_parallel_size=sp, routes=True)
    row = grid[ps.get_data_parallel_rank()]
    cp_rank, cp_group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()

    def logprobs_of(micro_batches):
        batches = [policy_batch(mb, cp_rank, cp) for mb in micro_batches]
        outputs = forward_logprobs(model, batches, hooks=[routing])
        out = {}
        for mb, batch, logprobs in zip(micro_batches, batches, outputs or []):
            row_logprobs, row_mask = _gather(logprobs, cp_group), _gather(batch.loss_mask.float(), cp_group)
            for p in torch.nonzero(row_mask).flatten().tolist():  # output p predicts token p + 1
                out[(int(mb.sample_index[p + 1]), int(mb.position_ids[p + 1]))] = float(row_logprobs[p])
        merged = [None] * ps.get_data_parallel_world_size()
        torch.distributed.all_gather_object(merged, out, group=ps.get_data_parallel_group())
        return {k: v for part in merged for k, v in part.items()}

    with routing.measure():
        out = logprobs_of(row)
    stats = routing.statistics()
    padded = None
    if padding_seed is not None:
        rng = np.random.default_rng(padding_seed)
        for mb in row:
            if mb.routes is not None:
                for t in np.flatnonzero(~mb.routed):
                    for layer in range(arch.num_layers):
                        mb.routes[t, layer] = rng.permutation(arch.num_experts)[: arch.num_experts_per_tok]
        padded = logprobs_of(row)
    return out, stats, padded


def replayed_update(rank, world_size, arch, full, samples, granularity, bias_update_rate=None):
    """One policy_update with replay, `old_logprobs: recompute`, 2 mini-batches and a KL
    reference, with activation recomputation `granularity` ("none" or "full") (and megatron's
    expert-bias update rate, if given); (record, full weights after it with the routers' expert
    bias, the length of megatron's process-wide RouterReplay list). The record's
    `experts_used_are_the_replayed`: the MoE layers whose every token's experts (the router's
    routing map) in a replayed forward after the update are its routes."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_minibatches
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.transforms.routing import attach_routing

    parallel.initialize_model_parallel()
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.policy.loss import forward_logprobs, policy_batch

    recompute = {} if granularity == "none" else dict(recompute_granularity="full", recompute_method="uniform",
                                                      recompute_num_layers=1)  # fmt: skip
    if bias_update_rate is not None:
        recompute["moe_router_bias_update_rate"] = bias_update_rate
    model = build_gpt_model(arch, **recompute)
    load_full_state_dict(model, full)
    routing = attach_routing(model, "replay", arch.num_layers, arch.num_experts_per_tok)
    reference = build_gpt_model(arch)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False).eval()
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=4,
                                hooks=(routing,))  # fmt: skip
    config = AlgorithmConfig(type="ppo", policy_minibatches=2, old_logprobs="recompute", kl_coef=0.1,
                             routing_replay="replay")  # fmt: skip
    grid = pack_minibatches(samples, 2, (1, 0), SEQ_LEN, 1, routes=True)
    record = policy_update(trainable, grid[0], UpdateSettings(config), reference=reference)
    used = {}  # layer -> [tokens, experts] bool: the routing map of the last forward

    def keep_routing_map(module, args, output):
        used[module.layer_number - 1] = output[1].detach().clone()

    handles = [m.register_forward_hook(keep_routing_map) for m in model.modules() if isinstance(m, TopKRouter)]
    model.eval()
    differing = set()
    for mb in grid[0]:
        forward_logprobs(model, [policy_batch(mb)], hooks=[routing])
        routes = torch.as_tensor(np.asarray(mb.routes, dtype=np.int64))  # [tokens, layers, k]
        for layer, routing_map in used.items():
            replayed = torch.zeros_like(routing_map).scatter_(1, routes[:, layer], True)
            if not torch.equal(routing_map, replayed):
                differing.add(layer)
    for handle in handles:
        handle.remove()
    record["experts_used_are_the_replayed"] = len(set(used) - differing)
    return record, gather_full_parameters(model), len(RouterReplay.global_router_replay_instances)

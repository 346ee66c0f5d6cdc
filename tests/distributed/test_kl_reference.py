"""The policy trainer's KL reference is built after megatron DDP and the optimizer (so it is not
resident while DDP allocates its buffers: config/memory_plan.py's start-up peak) and is still
exactly the initial policy: same weights and same logits as a model built from the initial
checkpoint without DDP, at EP=2 over two gloo ranks, with the distributed optimizer offloaded;
a training step of the policy leaves it unchanged (it shares no storage with DDP's buffer). Under
cpu_offload no hybrid optimizer but the trainer's is alive after construction (megatron's first
one, over the full parameters, is freed with its host copies: config/host_memory.py)."""

from __future__ import annotations

import json

import torch
import yaml

from megatron_rl.config import load_config, load_resolved
from megatron_rl.parallel import free_port
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks
from tests.support.tensors import tokens


def kl_config(tmp_path, hf_dir, distributed_optimizer: bool, cpu_offload: bool = False):
    """A CPU REINFORCE++ run with a KL reference whose policy (the tiny MoE) has 2 ranks at EP=2."""
    ports = [free_port() for _ in range(4)]
    config = {
        "model": {"hf_config": str(hf_dir), "checkpoint": str(hf_dir), "seq_len": 64, "dtype": "float32", "ep": 2},
        "optimizer": {"lr": 1e-2, "grad_clip": 1.0, "distributed_optimizer": distributed_optimizer},
        "algorithm": {"type": "grpo", "advantage": "reinforce_pp", "kl_coef": 0.1, "kl_estimator": "k2"},
        "orchestrator": {"num_steps": 2, "batch_size": 4, "group_size": 1, "max_prompt_tokens": 16,
                         "max_completion_tokens": 32},  # fmt: skip
        "inference": {"backend": "vllm-cpu", "base_port": ports[2], "weight_broadcast_port": ports[3]},
        "deployment": {"device": "cpu", "nodes": 1, "gpus_per_node": 4, "inference_gpus": 1, "policy_gpus": 2},
        "transport": {"policy_port": ports[0], "critic_port": ports[1], "receive_timeout_s": 60},
        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "save_interval": 1},
        "logging": {"dir": str(tmp_path / "logs")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    resolved = json.loads(load_config(path).to_json())
    # cpu_offload is refused for CPU deployments when a config is loaded; the rank function
    # emulates the hybrid optimizer's host copies instead (tests/support/host_offload.py)
    resolved["optimizer"]["cpu_offload"] = cpu_offload
    out = tmp_path / "resolved.json"
    out.write_text(json.dumps(resolved))
    return out


def test_reference_built_after_ddp_is_the_initial_policy(tiny_models, tmp_path):
    # the distributed optimizer with cpu_offload: the reference after DDP's buffers and after the
    # (emulated) hybrid optimizer; without offload the same order (toolbox examples run kl_coef > 0)
    cpu_offload = True
    path = kl_config(tmp_path, tiny_models["qwen3_moe"], True, cpu_offload)
    for rank in run_ranks(reference_after_ddp, 2, str(path)):
        if cpu_offload:  # only the trainer's hybrid optimizers are alive: megatron's first ones are freed
            assert rank["held_hybrids"] > 0 and rank["live_hybrids"] == rank["held_hybrids"]
        # built when DDP's buffers already held the policy's weights (the new order) ...
        assert rank["ddp_buffers_existed"] and rank["optimizer_existed"]
        # ... and equal, bit for bit, to the initial model built without DDP
        assert rank["weights_differing"] == [] and rank["num_weights"] > 10
        assert rank["reference_logits"].abs().sum() > 0
        torch.testing.assert_close(rank["reference_logits"], rank["initial_logits"], rtol=0, atol=0)
        # one optimizer step moves the policy, not the reference
        assert rank["policy_changed"] and rank["reference_unchanged_after_step"]


# Rank functions: module-level, so that the spawned ranks can import them.


def reference_after_ddp(rank, world_size, resolved_path):
    """Builds a PolicyTrainer and compares its reference with an initial model built apart."""
    import gc

    from megatron.core import parallel_state
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy import trainer as policy_trainer
    from megatron_rl.policy.trainer import PolicyTrainer, build_policy_model
    from megatron_rl.policy.update import policy_update
    from megatron_rl.trainer.optimizer import hybrid_optimizers
    from megatron_rl.trainer.weights import load_initial_weights

    resolved = load_resolved(resolved_path)
    if resolved.optimizer.cpu_offload and not torch.cuda.is_available():
        from tests.support import host_offload

        host_offload.install()
    seen = {}
    original = policy_trainer.build_reference

    def recording_build_reference(model, layout, resolved_config):
        # DDP gives every trained parameter a `main_grad` view into its gradient buffer
        seen["ddp_buffers_existed"] = all(hasattr(p, "main_grad") for p in model.parameters() if p.requires_grad)
        seen["optimizer_existed"] = hasattr(trainer_box.get("trainer"), "trainable")
        return original(model, layout, resolved_config)

    trainer_box = {}
    policy_trainer.build_reference = recording_build_reference
    original_init_hook = PolicyTrainer.after_optimizer

    def after_optimizer(self):
        trainer_box["trainer"] = self
        # what is alive once the trainer has built its optimizer (the automatic collector is off:
        # only a collection by the trainer frees what a reference cycle holds)
        seen["live_hybrids"] = sum(isinstance(o, HybridDeviceOptimizer) for o in gc.get_objects())
        original_init_hook(self)

    PolicyTrainer.after_optimizer = after_optimizer
    gc.disable()
    try:
        trainer = PolicyTrainer(resolved)
    finally:
        gc.enable()
        policy_trainer.build_reference = original
        PolicyTrainer.after_optimizer = original_init_hook

    held = len(hybrid_optimizers(trainer.trainable.optimizer))
    initial = build_policy_model(resolved, trainer.layout)
    load_initial_weights(initial, resolved.model.checkpoint, resolved.layout.policy_architecture)
    reference_state = trainer.reference.state_dict()
    initial_state = {k: v for k, v in initial.state_dict().items() if isinstance(v, torch.Tensor)}
    differing = [k for k, v in initial_state.items() if not torch.equal(reference_state[k], v)]

    input_ids = tokens(vocab=resolved.layout.policy_architecture.vocab_size)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    initial.eval()
    with torch.no_grad():
        initial_logits = initial(input_ids, positions, attention_mask=None)
        reference_logits = trainer.reference(input_ids, positions, attention_mask=None)

    before = {k: v.clone() for k, v in trainer.reference.state_dict().items() if isinstance(v, torch.Tensor)}
    policy_before = [p.detach().clone() for p in trainer.model.parameters()]
    samples = training_samples(4, resolved.layout.policy_architecture.vocab_size, seed=0)
    grid = pack_into_grid(samples, resolved.model.seq_len, trainer.layout.dp)
    data_rank = parallel_state.get_data_parallel_rank()
    policy_update(trainer.trainable, grid[data_rank], trainer.settings, reference=trainer.reference)
    policy_changed = any(not torch.equal(a, p.detach()) for a, p in zip(policy_before, trainer.model.parameters()))
    after = trainer.reference.state_dict()
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    trainer.close()
    return {
        **seen,
        "held_hybrids": held,
        "weights_differing": differing,
        "num_weights": len(initial_state),
        "initial_logits": initial_logits,
        "reference_logits": reference_logits,
        "policy_changed": policy_changed,
        "reference_unchanged_after_step": unchanged,
    }

"""Multi-latent attention (DeepSeek-V3's MLA) trains at TP = 2 as in one process.

megatron-core 0.16.1 does not sum the gradient of MLA's shared RoPE key (the last
qk_rope_head_dim outputs of linear_kv_down_proj, HF kv_a_proj_with_mqa's rows after the kv
latent) over TP: each rank uses the key for its own heads only. The compat patch
`latent_attention_shared_rope_grad` sums it (megatron_rl/compat/patches.py). Here two training
steps at TP = 2 give one process's gradients and updated weights for every parameter, the key's
rows in particular, for the full model and for LoRA on every attention linear:

- megatron's local spec, without sequence parallel (a dense MLA model whose query has one
  projection, Moonlight's q_lora_rank null) and with it (an MoE model at TP = 2, q_lora_rank set,
  YaRN RoPE): megatron splits the down-projections over TP and gathers them;
- TE's spec (CPU stand-ins, tests/support/te_standins.py): the down-projections duplicated on
  every rank; without sequence parallel megatron leaves the key's gradient partial there too,
  with it megatron's own sequence gather sums it (the patch must not sum it twice).

The models are built directly (not from a run config), so the tests do not depend on what the
config accepts.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.config.model import YarnRope
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks

MLA = dict(family="deepseek_v3", hidden_size=48, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
           intermediate_size=64, vocab_size=96, kv_lora_rank=18, qk_nope_head_dim=8, qk_rope_head_dim=6,
           v_head_dim=10)  # fmt: skip
# kv_lora_rank + qk_rope_head_dim = 24: at TP = 2 rank 1's half of linear_kv_down_proj holds rows
# 12-23, the key's rows 18-23 among them
DENSE_MLA = Architecture(**MLA)
MOE_MLA = Architecture(
    **MLA, q_lora_rank=22, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    rope_yarn=YarnRope(factor=4.0, original_max_position_embeddings=16, beta_fast=8.0, mscale=0.9, mscale_all_dim=0.7),
)  # fmt: skip
KEY_ROWS = slice(MLA["kv_lora_rank"], MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"])
ATTENTION = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
             "linear_proj")  # fmt: skip
SEQ_LEN, STEPS = 48, 2


def mla_steps(rank, world_size, archs, tp, specs, weights=None):
    """For each layer spec in `specs` ("local"; "te": TE's spec with the CPU stand-ins) and each
    arch: the full model, then the model with LoRA on its attention linears, each trained for
    STEPS steps at TP = tp from the full weights saved (torch.save) in the file `weights`, one dict
    per arch (None: this process draws them, at TP = 1). {spec: per arch {mode: each step's loss,
    full gradients and full parameters after it}}, and "weights": the weights drawn."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import (
        full_parameters,
        gather_full_gradients,
        gather_full_parameters,
        load_full_state_dict,
    )
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step
    from megatron_rl.transforms.lora import apply_lora
    from tests.support.te_standins import build_te_style_model

    parallel.initialize_model_parallel(tp=tp, seed=5)
    if weights is None:
        full = []
        for index, arch in enumerate(archs):
            torch.manual_seed(7 + index)
            full.append(full_parameters(build_gpt_model(arch, seq_len=SEQ_LEN)))
    else:
        full = torch.load(weights)
    results = {"weights": full if weights is None else None}
    for spec in specs:
        results[spec] = []
        for arch, drawn in zip(archs, full, strict=True):
            out = {}
            for lora in (False, True):
                if spec == "te":
                    model = build_te_style_model(arch, tp=tp)
                else:
                    model = build_gpt_model(arch, tp=tp, transformer_engine=False, seq_len=SEQ_LEN)
                load_full_state_dict(model, drawn)
                if lora:
                    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
                    apply_lora(model, 4, 8.0, tuple(t for t in ATTENTION if t in present), seed=11)
                # no clipping: each gradient compared as it is; an eps of Adam above most gradients
                # makes the update near lr / eps x g, where float32 noise in g stays small
                optimizer = OptimizerConfig(lr=1e-2, grad_clip=0.0, adam_eps=1e-3)
                trainable = build_trainable(model, optimizer, total_steps=10)
                sp = tp if model.config.sequence_parallel else 1
                samples = training_samples(4, arch.vocab_size, seed=3)
                grid = pack_into_grid(samples, SEQ_LEN, 1, 1, sequence_parallel_size=sp)
                loss_func = policy_loss_func(AlgorithmConfig(type="grpo"))
                steps = []
                for _ in range(STEPS):
                    metrics = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], loss_func)
                    steps.append({"loss": metrics["loss"], "grads": gather_full_gradients(model),
                                  "params": gather_full_parameters(model)})  # fmt: skip
                out["lora" if lora else "full"] = {"sequence_parallel": model.config.sequence_parallel,
                                                   "steps": steps}  # fmt: skip
            results[spec].append(out)
    return results


def assert_equal_to_one_process(reference, ranks, spec):
    for rank in ranks:
        for arch, got, expected in zip(("dense", "moe"), rank, reference, strict=True):
            assert got["full"]["sequence_parallel"] == (arch == "moe")  # megatron's SP for MoE at TP > 1
            for mode in ("full", "lora"):
                checked_key = 0
                for step, (mine, theirs) in enumerate(zip(got[mode]["steps"], expected[mode]["steps"], strict=True)):
                    where = f"{spec} spec, {arch}, {mode}, step {step}"
                    assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5), where
                    assert sorted(mine["grads"]) == sorted(theirs["grads"]) and mine["grads"], where
                    for name, grad in theirs["grads"].items():
                        scale = float(grad.abs().max())
                        torch.testing.assert_close(mine["grads"][name], grad, rtol=0, atol=1e-5 * max(scale, 1e-3),
                                                   msg=f"{where}: the gradient of {name}")  # fmt: skip
                        if "linear_kv_down_proj" in name and name.endswith(("weight", "lora_b")):
                            # the shared RoPE key's rows, on their own scale (a rank's heads' part of
                            # their gradient is off by about the whole)
                            key = float(grad[KEY_ROWS].abs().max())
                            assert key > 1e-7, f"{where}: {name}'s key rows have no gradient"
                            torch.testing.assert_close(mine["grads"][name][KEY_ROWS], grad[KEY_ROWS], rtol=0,
                                                       atol=1e-3 * key, msg=f"{where}: {name}'s key rows")  # fmt: skip
                            checked_key += 1
                    for name, param in theirs["params"].items():
                        torch.testing.assert_close(mine["params"][name], param, rtol=0, atol=1e-6,
                                                   msg=f"{where}: {name} after the step")  # fmt: skip
                # each layer's kv down-projection key rows, at each step: its weight's (full model),
                # or its B's (LoRA: the base weight is frozen and has no gradient)
                assert checked_key == MLA["num_layers"] * STEPS, where


def test_mla_training_at_tp2_equals_one_process_on_the_local_and_te_specs(tmp_path):
    """Both specs at TP = 2 against the local spec in one process (TP = 1: the two specs compute
    alike there); the models' parameters compared by their local-spec names."""
    reference = run_ranks(mla_steps, 1, (DENSE_MLA, MOE_MLA), 1, ("local",))[0]
    weights = tmp_path / "weights.pt"
    torch.save(reference["weights"], weights)
    ranks = run_ranks(mla_steps, 2, (DENSE_MLA, MOE_MLA), 2, ("local", "te"), str(weights))
    for spec in ("local", "te"):
        assert_equal_to_one_process(reference["local"], [rank[spec] for rank in ranks], spec)

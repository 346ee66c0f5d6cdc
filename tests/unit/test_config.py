"""Config rules: each bad config gets an error naming the key path and what was expected."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import ConfigError, load_config, load_resolved, parse_config
from tests.support.configs import ARCH, base

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"

MOE_ARCH = {
    **ARCH,
    "family": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


def errors_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="test.yaml")
    return str(info.value)


def test_valid_configs_resolve_with_derived_layout():
    resolved = parse_config(base("sao"))
    assert resolved.layout.policy.dp == 4 and resolved.layout.critic.dp == 2
    assert resolved.layout.deployment_style == "shared"
    assert resolved.algorithm.eps_low == 0.3 and resolved.algorithm.eps_high == 5.0
    assert resolved.algorithm.length_adaptive_alpha == 1.5
    grpo = parse_config(base("grpo"))
    assert grpo.layout.critic is None and grpo.value is None and grpo.layout.deployment_style == "none"
    assert grpo.algorithm.eps_high == 0.2


def test_user_setting_beats_algorithm_default():
    data = base("sao")
    data["algorithm"]["eps_high"] = 2.0
    assert parse_config(data).algorithm.eps_high == 2.0


def test_mixed_layouts_derive_each_models_dp():
    data = base("ppo")
    data["deployment"] = {
        "nodes": 3,
        "gpus_per_node": 8,
        "inference_gpus": 8,
        "policy_gpus": 8,
        "num_value_nodes": 1,
    }
    data["inference"] = {"num_servers": 4, "tp": 2}
    data["model"].update(tp=2, cp=2)  # 8 / (2*2) = 2
    data["value"]["model"].update(tp=1, cp=4)  # 8 / 4 = 2 ... critic has its own degrees
    data["value"]["model"]["architecture"] = dict(MOE_ARCH)
    data["value"]["model"]["ep"] = 4
    resolved = parse_config(data)
    assert (resolved.layout.policy.dp, resolved.layout.policy.world_size) == (2, 8)
    assert (resolved.layout.critic.dp, resolved.layout.critic.cp, resolved.layout.critic.world_size) == (
        2,
        4,
        8,
    )
    assert resolved.layout.critic.expert_dp == 2
    assert resolved.layout.deployment_style == "dedicated" and resolved.layout.value_gpus == 8


def test_unknown_key_is_an_error_naming_its_path():
    data = base()
    data["value"]["model"]["tensor_parallel"] = 2
    assert "value.model.tensor_parallel: unknown key" in errors_of(data)
    data = base()
    data["orchestartor"] = {}
    assert "orchestartor: unknown key" in errors_of(data)


def test_error_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**base(), "algorithm": {"type": "sao", "gamma": 2}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "algorithm.gamma" in str(info.value)


def test_missing_required_key():
    data = base()
    del data["model"]["seq_len"]
    assert "model.seq_len: required key is missing" in errors_of(data)


def test_ppo_and_sao_need_a_value_section():
    for algorithm in ("ppo", "sao"):
        data = base(algorithm)
        del data["value"]
        del data["deployment"]["num_value_gpus_per_train_node"]
        assert f"value: algorithm.advantage 'gae' (algorithm.type '{algorithm}') needs a value section" in errors_of(data)


def test_grpo_takes_no_value_section_and_needs_groups():
    data = base("grpo")
    data["value"] = base("sao")["value"]
    assert "algorithm.advantage 'grpo' (algorithm.type 'grpo') reads no critic" in errors_of(data)
    data = base("grpo")
    data["orchestrator"]["group_size"] = 1
    assert "orchestrator.group_size" in errors_of(data)


def test_group_size_one_allowed_for_sao_and_ppo():
    for algorithm in ("sao", "ppo"):
        data = base(algorithm)
        data["orchestrator"]["group_size"] = 1
        assert parse_config(data).orchestrator.group_size == 1


def test_longest_sample_must_fit_both_models():
    data = base()
    data["value"]["model"]["seq_len"] = 150
    message = errors_of(data)
    assert "value.model.seq_len (150) is shorter than the longest possible sample" in message
    assert "192 tokens" in message and "model.seq_len" not in message.replace("value.model.seq_len", "")
    data = base()
    data["model"]["seq_len"] = 100
    assert "model.seq_len (100)" in errors_of(data)


def test_gpu_counts_must_divide_by_model_parallel_degrees():
    data = base()
    data["model"]["tp"] = 8  # 4 policy GPUs
    assert "model: 4 GPUs are not divisible by tp*cp*pp" in errors_of(data)
    data = base()
    data["value"]["model"]["cp"] = 4  # 2 critic GPUs
    assert "value.model: 2 GPUs are not divisible" in errors_of(data)


def test_heads_divisible_by_tp_and_cp():
    data = base()
    data["model"]["architecture"]["num_attention_heads"] = 12
    data["model"]["architecture"]["num_key_value_heads"] = 6
    data["model"].update(tp=2, cp=2)  # 12 % 4 == 0 fine; kv 6 % 2 fine
    assert parse_config(data).layout.policy.dp == 1
    data["model"]["architecture"]["num_attention_heads"] = 6
    data["model"]["architecture"]["num_key_value_heads"] = 6
    assert "num_attention_heads (6) must be divisible by tp*cp (2*2)" in errors_of(data)
    data = base()
    data["model"]["architecture"]["num_key_value_heads"] = 1
    data["model"]["tp"] = 2
    assert "num_key_value_heads (1) must be divisible by tp (2)" in errors_of(data)


def test_experts_divisible_by_ep_and_ep_fits_dp():
    data = base()
    data["model"]["architecture"] = dict(MOE_ARCH, num_experts=6)
    data["model"]["ep"] = 4
    assert "model.ep: num_experts (6) must be divisible by ep (4)" in errors_of(data)
    data = base()
    data["model"]["architecture"] = dict(MOE_ARCH)
    data["model"].update(ep=4, tp=2)  # dp = 2, dp*cp = 2
    assert "model.ep: ep (4) must divide dp*cp (2*1)" in errors_of(data)
    data = base()
    data["model"]["ep"] = 2
    assert "model.ep: ep = 2 but the model has no experts" in errors_of(data)


def test_ports_must_be_distinct():
    data = base()
    data["value"]["service"] = {"port": 5555}
    assert "value.service.port: port 5555 is already used by transport.policy_port" in errors_of(data)
    data = base()
    data["transport"] = {"critic_port": 8001}  # inference servers use 8000, 8001
    assert "port 8001 is already used by transport.critic_port" in errors_of(data)


def test_deployment_capacity_and_critic_gpus():
    data = base()
    data["deployment"]["policy_gpus"] = 6  # 2 + 6 + 2 > 8
    assert "exceeds nodes*gpus_per_node = 8" in errors_of(data)
    data = base()
    del data["deployment"]["num_value_gpus_per_train_node"]
    assert "the value section needs critic GPUs" in errors_of(data)
    data = base()
    data["deployment"]["num_value_nodes"] = 1
    assert "not both" in errors_of(data)


def test_hf_config_directory(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 512,
            }
        )
    )
    data = base()
    data["model"] = {"hf_config": "hf", "seq_len": 256}
    data["value"]["model"] = {"hf_config": str(hf), "seq_len": 256}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    resolved = load_config(path)
    assert resolved.layout.policy_architecture.family == "llama"
    assert resolved.layout.policy_architecture.qk_norm is False
    assert resolved.model.hf_config == str(hf.resolve())  # made absolute for every process
    data["model"]["hf_config"] = "missing"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"model.hf_config: no config.json in .*missing"):
        load_config(path)
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    data["model"]["hf_config"] = "hf"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"model_type 'gpt2' has no builder mapping"):
        load_config(path)


def test_exactly_one_model_source():
    data = base()
    data["model"]["hf_config"] = "/somewhere"
    assert "give exactly one of hf_config" in errors_of(data)


def test_resolved_json_round_trips(tmp_path):
    resolved = parse_config(base())
    path = tmp_path / "resolved.json"
    path.write_text(resolved.to_json())
    again = load_resolved(path)
    assert again == resolved
    assert again.layout.critic.dp == 2


def test_every_example_config_checks():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        resolved = load_config(path)
        assert resolved.layout.policy.world_size == resolved.deployment.policy_gpus


def test_example_30b_layout():
    resolved = load_config(EXAMPLES / "qwen3_30b_a3b_sao.yaml")
    assert (resolved.layout.policy.ep, resolved.layout.policy.dp) == (2, 2)
    assert resolved.layout.critic.world_size == 2 and resolved.layout.deployment_style == "shared"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.launch.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_check_config_cli(tmp_path):
    done = _cli("check-config", str(EXAMPLES / "tiny_cpu_sao.yaml"))
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["layout"]["policy"]["dp"] == 1 and printed["layout"]["critic"]["dp"] == 1
    data = copy.deepcopy(yaml.safe_load((EXAMPLES / "tiny_cpu_sao.yaml").read_text()))
    del data["value"]
    del data["deployment"]["num_value_gpus_per_train_node"]
    bad = tmp_path / "no_value.yaml"
    bad.write_text(yaml.safe_dump(data))
    done = _cli("check-config", str(bad))
    assert done.returncode == 2
    assert "value: algorithm.advantage 'gae' (algorithm.type 'sao') needs a value section" in done.stderr
    assert str(bad) in done.stderr


def test_value_pretraining_and_snapshot_rules():
    config = base()
    config["value"]["pretrain_jsonl"] = "values.jsonl"
    assert "value.pretrain_jsonl / value.pretrain_steps" in errors_of(config)
    config = base()
    config["orchestrator"]["num_steps"] = 10
    config["value"]["snapshot"] = {"steps": [0, 4, 4, 10]}
    message = errors_of(config)
    assert "value.snapshot.steps: [0, 10] outside 1..9" in message and "repeated steps" in message
    config = base()
    config["orchestrator"]["num_steps"] = 10
    config["value"]["snapshot"] = {"steps": [3]}
    config["value"]["model"]["architecture"]["num_layers"] = 2
    assert "differs from the policy's in ['num_layers']" in errors_of(config)
    config["value"]["model"]["architecture"]["num_layers"] = 4
    config["value"]["lora"] = {"rank": 4}
    assert "a snapshot replaces the backbone that LoRA adapts" in errors_of(config)
    del config["value"]["lora"]
    resolved = parse_config(config, source="test.yaml")
    assert resolved.value.snapshot.steps == [3] and resolved.value.snapshot.head_only_retune_steps == 0


def test_seq_len_must_split_over_cp_and_sequence_parallel_tp():
    """A valid score request must never make the critic's packing fail: seq_len divides by cp
    (and by tp where the builder turns on sequence parallel: MoE at tp > 1), for both models."""
    data = base()
    data["orchestrator"]["max_completion_tokens"] = 100
    data["model"].update(seq_len=251, cp=2)
    assert "model.seq_len (251) must be a multiple of cp (2)" in errors_of(data)
    data = base()
    data["orchestrator"]["max_completion_tokens"] = 100
    data["value"]["model"] = {"architecture": dict(MOE_ARCH), "seq_len": 255, "tp": 2}
    assert "value.model.seq_len (255) must be a multiple of cp (1) x tp (2, sequence parallel for MoE)" in errors_of(data)
    data["value"]["model"]["seq_len"] = 256
    parse_config(data)


def test_safetensors_weight_update_publishes_under_checkpoint_dir_by_default():
    data = base()
    data["inference"]["weight_update"] = "safetensors"
    data["checkpoint"] = {"dir": "/runs/x/checkpoints"}
    assert parse_config(data).inference.publish_dir == "/runs/x/checkpoints/published"
    data["inference"]["publish_dir"] = "/elsewhere"
    assert parse_config(data).inference.publish_dir == "/elsewhere"
    data = base()  # path (b) needs none
    assert parse_config(data).inference.publish_dir is None


def test_recompute_old_logprobs_is_not_a_key():
    """It was accepted and never read; the sampler's log-probabilities are the ratio's denominator."""
    data = base()
    data["algorithm"]["recompute_old_logprobs"] = True
    assert "algorithm.recompute_old_logprobs: unknown key" in errors_of(data)


def test_training_rollouts_must_sample_the_whole_vocabulary():
    """top_p < 1 would bias every ratio by the kept probability mass: refused, saying why."""
    data = base()
    data["orchestrator"]["top_p"] = 0.9
    message = errors_of(data)
    assert "orchestrator.top_p (0.9): training rollouts must sample the whole vocabulary" in message
    assert "kept probability mass" in message and "Set top_p: 1.0" in message
    data["orchestrator"]["top_p"] = 1.0
    data["orchestrator"]["temperature"] = 0.6
    assert parse_config(data).orchestrator.temperature == 0.6


def test_update_options_and_their_rules():
    data = base("ppo")
    data["algorithm"].update(policy_minibatches=4, policy_epochs=2, old_logprobs="recompute",
                             loss_aggregation="seq-mean-token-sum-norm", loss_scale_factor=512,
                             entropy_coef=0.001, kl_estimator="low_var_kl",
                             rollout_correction={"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"})  # fmt: skip
    resolved = parse_config(data)
    assert resolved.algorithm.optimizer_steps_per_step == 8
    assert resolved.algorithm.rollout_correction.importance_bounds() == (0.5, 2.0)
    # Rollout correction weighs pi_old / pi_sampler: with the sampler's log-probs as pi_old it is 1.
    data["algorithm"]["old_logprobs"] = "sampler"
    assert "algorithm.rollout_correction: needs algorithm.old_logprobs 'recompute'" in errors_of(data)
    data = base("ppo")
    data["algorithm"]["loss_scale_factor"] = 512
    assert "algorithm.loss_scale_factor: only read by loss_aggregation 'seq-mean-token-sum-norm'" in errors_of(data)
    data = base("ppo")
    data["algorithm"]["policy_minibatches"] = 10_000
    assert "algorithm.policy_minibatches (10000) exceeds the samples of a step" in errors_of(data)
    data = base("ppo")
    data["algorithm"]["rollout_correction"] = {"rollout_is": "token", "rollout_is_threshold": "x"}
    assert "algorithm.rollout_correction.rollout_is_threshold" in errors_of(data)
    data["algorithm"]["rollout_correction"] = {"rollout_rs": "token_k9", "rollout_rs_threshold": 1}
    assert "unknown rule(s) ['token_k9']" in errors_of(data)
    data["algorithm"]["rollout_correction"] = {}
    data["algorithm"]["loss_aggregation"] = "seq-mean"
    message = errors_of(data)
    assert "algorithm.loss_aggregation" in message and "set rollout_is, rollout_rs or both" in message
    data = base("ppo")
    data["algorithm"]["policy_epochs"] = 0
    assert "algorithm.policy_epochs" in errors_of(data)


def test_offload_and_recompute_options_are_checked_and_reach_megatron():
    """optimizer.cpu_offload / offload_fraction map to megatron's hybrid device optimizer
    (optimizer_cpu_offload, optimizer_offload_fraction), model.recompute to
    recompute_granularity / _method / _num_layers, for the policy and the critic."""
    import torch

    from megatron_rl.models.builder import transformer_config
    from megatron_rl.trainer.optimizer import megatron_optimizer_config

    data = base()
    data["deployment"]["device"] = "cpu"
    data["optimizer"] = {"cpu_offload": True}
    data["value"]["optimizer"] = {"cpu_offload": True, "distributed_optimizer": False}
    text = errors_of(data)
    assert "optimizer.cpu_offload: needs CUDA" in text and "value.optimizer.cpu_offload: needs CUDA" in text
    assert "value.optimizer.cpu_offload: needs value.optimizer.distributed_optimizer: true" in text
    data = base()
    data["model"]["recompute"] = {"granularity": "full"}
    assert "granularity 'full' needs method" in errors_of(data)
    data["model"]["recompute"] = {"granularity": "selective", "num_layers": 2}
    assert "apply to granularity 'full' only" in errors_of(data)
    data["model"]["recompute"] = {"granularity": "full", "method": "uniform", "num_layers": 3}
    assert "model.recompute.num_layers (3) must divide the 4 layers" in errors_of(data)
    data["value"]["model"]["recompute"] = {"granularity": "full", "method": "block", "num_layers": 5}
    assert "value.model.recompute.num_layers (5) exceeds the 4 layers" in errors_of(data)

    resolved = load_config(EXAMPLES / "qwen3_30b_a3b_sao.yaml")
    for model, optimizer in ((resolved.model, resolved.optimizer), (resolved.value.model, resolved.value.optimizer)):
        assert optimizer.cpu_offload and model.recompute.granularity == "full"
        fields = model.recompute.transformer_fields()
        assert fields == {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        arch = resolved.layout.policy_architecture.model_copy(update={"num_layers": 2, "num_experts": 0})
        config = transformer_config(arch, dtype="bfloat16", **fields)
        assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 1)
        megatron = megatron_optimizer_config(optimizer, config)
        assert megatron.optimizer_cpu_offload and megatron.optimizer_offload_fraction == 1.0
        assert megatron.use_distributed_optimizer and megatron.params_dtype == torch.bfloat16
    assert megatron_optimizer_config(parse_config(base()).optimizer, config).optimizer_offload_fraction == 0.0

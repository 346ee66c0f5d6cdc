"""The demo's run config for every algorithm and task resolves (`megatron-rl check-config`'s
rules) and says what the demo's docs say: SAO one sample a prompt, PPO and GRPO groups of 4, 64
rollouts a step, a critic for SAO and PPO only (frozen attention for SAO), and the tool task's
calculator environment. The demo itself runs SAO end to end in tests/e2e/test_demo.py; PPO and
GRPO differ from it only in this config."""

from __future__ import annotations

import pytest

from megatron_rl.config import parse_config
from megatron_rl.demo.run import ASYNC, DEFAULTS, TOOL, demo_config
from megatron_rl.demo.warm_start import TOOL_TASK


@pytest.mark.parametrize("task", ["count", "tool"])
@pytest.mark.parametrize("algo", ["sao", "ppo", "grpo"])
def test_the_demo_config_of_each_algorithm_resolves(algo, task, tiny_models, tmp_path):
    model = tiny_models["qwen3"]
    lr = TOOL["lr"] if task == "tool" else DEFAULTS["lr"]
    data = demo_config(tmp_path, algo, 7, 1, model, model, model, task=task, lr=lr)
    resolved = parse_config(data)
    o = resolved.orchestrator
    assert o.num_steps == 7 and o.seed == 1 and resolved.optimizer.lr == lr
    assert o.group_size == (1 if algo == "sao" else 4) and o.batch_size * o.group_size == DEFAULTS["rollouts"]
    assert (resolved.value is not None) == (algo != "grpo")
    if resolved.value is not None:
        assert resolved.value.freeze_attention == (algo == "sao") and resolved.value.epochs_per_step == 2
    if task == "tool":
        assert (o.environment, o.environment_args) == TOOL_TASK
        assert o.max_completion_tokens == TOOL["max_completion_tokens"]
    else:
        assert (o.environment, o.dataset) == ("procedural", "count")


def test_a_rollout_count_that_does_not_fill_groups_is_refused(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    with pytest.raises(SystemExit, match="--rollouts 6: must be a positive multiple of the group size 4"):
        demo_config(tmp_path, "ppo", 3, 0, model, model, model, rollouts=6)


@pytest.mark.parametrize("algo", ["sao", "ppo"])
def test_the_async_preset_resolves_and_a_set_wins_over_it(algo, tiny_models, tmp_path):
    model = tiny_models["qwen3"]
    overrides = [f"{key}={value}" for key, value in ASYNC.items()] + ["orchestrator.oversample=8"]
    resolved = parse_config(demo_config(tmp_path, algo, 7, 1, model, model, model, overrides=overrides))
    o = resolved.orchestrator
    assert (o.max_async_level, o.max_off_policy_steps, o.batch_order, o.oversample) == (2, 4, "finish", 8)
    assert resolved.inference.update_mode == "interrupt" and resolved.algorithm.value_targets == "version_bootstrap"


@pytest.mark.parametrize("algo", ["grpo", "sao"])
def test_the_distill_demo_serves_its_teacher_on_a_process_of_its_own(algo, tiny_models, tmp_path):
    """`--distill`: the teacher is served by the run (no url), on one more CPU process, on its own
    seed-derived ports; the same config without a teacher is RL alone."""
    model = tiny_models["qwen3"]
    alone = parse_config(demo_config(tmp_path, algo, 7, 1, model, model, model))
    taught = parse_config(demo_config(tmp_path, algo, 7, 1, model, model, model, teacher=model, distill_coef=0.3))
    assert alone.distillation is None and alone.layout.services == {}
    assert taught.distillation.coef == 0.3 and taught.distillation.teacher.url is None
    service = taught.layout.services["teacher"]
    assert service.gpus == 1 and service.model_dir == str(model) and service.url == "http://127.0.0.1:25001"
    assert taught.deployment.gpus_per_node == alone.deployment.gpus_per_node + 1

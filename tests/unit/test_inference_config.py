"""The inference side's configuration: router options sized from the config, ports, the
rollout trajectory's bookkeeping. The processes themselves are tested in tests/e2e."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, parse_config
from megatron_rl.inference.pool import router_settings
from megatron_rl.inference.rollout import Completion, SamplingParams, TokenTrajectory
from megatron_rl.inference.router import RouterSettings, router_command
from megatron_rl.policy.publish.publisher import versions_kept
from tests.support.configs import base


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_router_command_has_the_options_rl_batches_need():
    command = router_command(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], "10.0.0.1", 8050, 9100,
                             RouterSettings(request_timeout_s=7200, queue_size=5000))  # fmt: skip
    assert command[command.index("--worker-urls") + 1 : command.index("--worker-urls") + 3] == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
    ]
    assert option(command, "--host") == "10.0.0.1" and option(command, "--port") == "8050"
    assert option(command, "--policy") == "consistent_hash"
    assert option(command, "--request-id-headers") == "x-session-id"
    assert option(command, "--health-check-timeout-secs") == "30"
    assert int(option(command, "--health-failure-threshold")) > 1
    assert option(command, "--request-timeout-secs") == "7200" and option(command, "--queue-size") == "5000"
    assert (
        option(command, "--prometheus-host") == "127.0.0.1" and option(command, "--prometheus-port") == "9100"
    )


def test_a_failure_threshold_of_one_is_refused():
    with pytest.raises(ValueError, match="health_failure_threshold must be above 1"):
        router_command(["http://a:1"], "127.0.0.1", 1, 2, RouterSettings(health_failure_threshold=1))
    data = base()
    data["inference"] = {"router_health_failure_threshold": 1}
    with pytest.raises(ConfigError, match="router_health_failure_threshold"):
        parse_config(data)


def test_router_queue_and_timeouts_are_sized_from_the_config():
    data = base()
    data["orchestrator"].update(batch_size=512, group_size=8, max_async_level=2)
    data["inference"] = {"request_timeout_s": 5400, "num_servers": 2}
    settings = router_settings(parse_config(data))
    in_flight = 512 * 8 * 3
    assert settings.queue_size >= in_flight and settings.max_concurrent_requests >= in_flight
    assert settings.request_timeout_s == settings.queue_timeout_s == 5400  # not the 60 s default


def test_router_port_is_checked_against_the_other_ports():
    data = base()
    data["inference"] = {"router_port": data.get("transport", {}).get("policy_port", 5555)}
    with pytest.raises(ConfigError, match="inference.router_port"):
        parse_config(data)


def test_sampling_params_come_from_the_orchestrator_config():
    data = base()
    data["orchestrator"].update(temperature=0.7, top_p=1.0, seed=4)
    sampling = SamplingParams.from_config(parse_config(data).orchestrator)
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.7, 1.0, 4)
    assert sampling.max_tokens == data["orchestrator"]["max_completion_tokens"]


def test_trajectory_extends_the_exact_tokens_with_masks_and_versions():
    trajectory = TokenTrajectory(prompt_ids=[1, 2, 3])
    trajectory.add_completion(Completion([7, 8], [-0.1, -0.2], "stop", policy_version=4, worker="w"))
    trajectory.add_observation([50, 51, 52])
    trajectory.add_completion(Completion([9], [-0.3], "length", policy_version=3, worker="w"))
    assert trajectory.token_ids == [1, 2, 3, 7, 8, 50, 51, 52, 9]
    assert trajectory.loss_mask == [False] * 3 + [True] * 2 + [False] * 3 + [True]
    assert trajectory.logprobs == [0.0] * 3 + [-0.1, -0.2] + [0.0] * 3 + [-0.3]
    assert trajectory.policy_version == 3 and trajectory.finish_reason == "length"


def test_servers_from_config_use_the_given_devices_and_options(tmp_path):
    data = base()
    data["deployment"].update(inference_gpus=4, policy_gpus=2)
    data["inference"] = {"num_servers": 2, "tp": 2, "gpu_memory_utilization": 0.7, "base_port": 9000,
                         "extra_args": ["--enable-prefix-caching"], "served_model_name": "policy"}  # fmt: skip
    from megatron_rl.inference.pool import InferencePool

    resolved = parse_config(data)
    servers = InferencePool.from_config(
        resolved, [["2", "5"], ["7", "0"]], tmp_path, model_dir=tmp_path, launch=False
    )
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == ["2,5", "7,0"]  # never assumed 0..N-1
    assert [s.port for s in servers] == [9000, 9001]
    for server in servers:
        assert option(server.command, "--tensor-parallel-size") == "2"
        assert option(server.command, "--gpu-memory-utilization") == "0.7"
        assert option(server.command, "--served-model-name") == "policy"
        assert server.command[-1] == "--enable-prefix-caching"
        assert server.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert option(server.command, "--shutdown-timeout") == "1"  # drain: no EngineDeadError on stop
        # The log-prob of each sampled token is of softmax(logits / T), what it was drawn from.
        assert option(server.command, "--logprobs-mode") == "processed_logprobs"
    data["inference"]["shutdown_timeout_s"] = 0  # vLLM's abort, and what a vLLM without the option needs
    [server, _] = InferencePool.from_config(parse_config(data), [["2", "5"], ["7", "0"]], tmp_path,
                                            model_dir=tmp_path, launch=False)  # fmt: skip
    assert "--shutdown-timeout" not in server.command and "--trust-remote-code" not in server.command
    data["model"]["trust_remote_code"] = True  # the tokenizer's own code (Moonlight): vLLM runs it too
    [server, _] = InferencePool.from_config(parse_config(data), [["2", "5"], ["7", "0"]], tmp_path,
                                            model_dir=tmp_path, launch=False)  # fmt: skip
    assert "--trust-remote-code" in server.command
    with pytest.raises(ValueError, match="3 devices"):
        InferencePool.from_config(
            resolved, [["1", "2", "3"], ["4", "5"]], tmp_path, model_dir=tmp_path, launch=False
        )


def test_an_api_key_from_the_environment_reaches_servers_router_and_clients(tmp_path, monkeypatch):
    """inference.api_key_env: vLLM and the router get --api-key, our controls and rollout client
    send it; without the variable the error names key and variable."""
    from megatron_rl.inference.pool import InferencePool

    data = base()
    data["inference"] = {"num_servers": 2, "api_key_env": "VLLM_KEY"}
    resolved = parse_config(data)
    monkeypatch.delenv("VLLM_KEY", raising=False)
    with pytest.raises(ConfigError, match="inference.api_key_env names the environment variable VLLM_KEY"):
        InferencePool.from_config(resolved, [["0"], ["1"]], tmp_path, model_dir=tmp_path, launch=False)
    monkeypatch.setenv("VLLM_KEY", "k-123")
    servers = InferencePool.from_config(resolved, [["0"], ["1"]], tmp_path, model_dir=tmp_path, launch=False)
    assert all(option(s.command, "--api-key") == "k-123" for s in servers)
    assert all(s.control.headers == {"Authorization": "Bearer k-123"} for s in servers)
    settings = router_settings(resolved)
    assert option(router_command(["http://a:1"], "127.0.0.1", 8050, 9100, settings), "--api-key") == "k-123"


def test_path_a_keeps_every_version_a_server_may_still_be_loading():
    """At max_async_level L the policy may publish up to L + 1 versions past the live one while a
    server loads the next: those stay on disk (a version deleted under a loading server failed an
    L = 2 run of the async demo at step 13)."""
    for level in range(6):
        live = 10
        loading, newest = live + 1, live + level + 1
        assert versions_kept(level) >= newest - loading + 1 and versions_kept(level) >= 2
    assert [versions_kept(level) for level in (0, 1, 2, 8)] == [2, 3, 4, 10]

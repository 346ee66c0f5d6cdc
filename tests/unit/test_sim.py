"""The simulated cluster (megatron_rl/sim/cluster.py): the real orchestrator against stand-ins on
a virtual clock. A small run of benchmarks/scale.py (so the benchmark cannot rot); the same seed
gives the same events at the same simulated times; at 1,024 rollouts a step the orchestrator's
ordering invariants hold (one score call per group with every branch, critic grid and critic
trained before the policy grid, the staleness bound, the lead gate, every data rank with the
same micro-steps); the virtual clock and the models' inputs. Weight updates on the inference
stand-in: one request's re-prefill after an update, timed exactly and not counted busy, under
keep and interrupt; under interrupt every token's version was live while it was sampled and the
samples carry exactly those versions; finish order with oversample keeps the staleness bound and
counts what it drops; same seed, same events in either update mode; section 4 of the benchmark
small."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_rl.inference.rollout import SamplingParams
from megatron_rl.sim.cluster import SimCluster, cluster_config
from megatron_rl.sim.inference import SimInference
from megatron_rl.sim.models import ClusterModel, active_parameters, forward_flops
from megatron_rl.sim.virtual_clock import SimulationDeadlock, run_virtual

ROOT = Path(__file__).resolve().parents[2]
SAO = ROOT / "examples/configs/qwen3_30b_a3b_sao.yaml"
SHORT = dict(prompt_tokens=16, completion_median_tokens=24, completion_min_tokens=4, completion_sigma=0.8)


def small_run(tmp_path, seed=0, model=None, settings=None, **orchestrator):
    defaults = dict(batch_size=8, group_size=2, num_steps=3, max_completion_tokens=64, max_prompt_tokens=32)
    resolved = cluster_config(SAO, tmp_path, None, settings, **(defaults | orchestrator))
    return SimCluster(resolved, model or ClusterModel(**SHORT), seed=seed, run_dir=tmp_path).run()


def benchmark_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "benchmarks/scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scale_benchmark_runs_small(tmp_path, monkeypatch):
    module = benchmark_module(monkeypatch)
    out = tmp_path / "scale.json"
    argv = ["--sections", "1,2,3", "--sizes", "4,8", "--steps", "2", "--async-steps", "3", "--prompt-tokens", "16",
            "--completion-median-tokens", "24", "--completion-min-tokens", "4", "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    record = json.loads(out.read_text())
    assert [r["rollouts"] for r in record["scale"]] == [4, 8]
    for row in record["scale"]:
        assert row["orchestrator_cpu_s_per_step"] > 0 and row["step_s"] > 0
        assert row["score_calls_per_step"] == row["rollouts"]  # SAO: one group per rollout
        assert row["critic_grid_bytes_per_step"] > 0 and row["policy_grid_bytes_per_step"] > 0
    assert {(r["group_size"], r["max_async_level"]) for r in record["asynchrony"]} == {
        (g, level) for g in (1, 8) for level in (0, 1, 2)
    }
    assert all(0 < r["server_busy"] <= 1 and r["step_s"] >= 0 for r in record["asynchrony"])
    assert all(r["step_s"] > 0 for r in record["asynchrony"] if r["max_async_level"] == 0)
    # Routing replay: the policy grid carries 48 layers x top-8 uint8 experts and a flag a token more.
    assert record["routing_replay"]["bytes_per_token"] == record["routing_replay"]["expected_bytes_per_token"] == 385
    with pytest.raises(SystemExit):
        module.main(["--decode-tokens-per-s", "0", "--out", str(out)])  # a model parameter out of range
    with pytest.raises(SystemExit):
        module.main(["--sections", "5", "--out", str(out)])


def test_the_long_tail_section_runs_small(tmp_path, monkeypatch):
    module = benchmark_module(monkeypatch)
    out = tmp_path / "scale.json"
    argv = ["--sections", "4", "--tail-steps", "3", "--tail-rollouts", "8", "--tail-budget", "64", "--tail-seq-len", "2048",
            "--tail-median-tokens", "24", "--tail-levels", "1,2", "--tail-bounds", "1", "--tail-oversample", "4",
            "--tail-oversample-sweep", "", "--tail-what-if-broadcast", "5", "--prompt-tokens", "16", "--completion-min-tokens", "4", "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0 and not out.exists()  # section 4 alone writes its own file
    record = json.loads((tmp_path / "scale_tail.json").read_text())
    assert record["sync"]["ratio"] == 1.0 and record["context_parallel"] == 1  # 2,048 tokens fit without CP
    rows = {(r["batch_order"], r["update_mode"], r["max_async_level"], r["max_off_policy_steps"]) for r in record["rows"]}
    assert rows == {(order, mode, 1, 1) for order, mode in module.TAIL_ROWS}
    assert record["skipped"] == [{"max_async_level": 2, "max_off_policy_steps": 1}]
    assert all(r["oversample"] == (4 if r["batch_order"] == "finish" else 0) for r in record["rows"])
    what_if = record["what_if_broadcast"]  # the level-1 partial-rollout row again, against its own baseline
    assert what_if["sync"]["ratio"] == 1.0 and [r["oversample"] for r in what_if["rows"]] == [4]
    assert what_if["sync"]["step_s"] < record["sync"]["step_s"]  # a 5 s broadcast instead of 48.7 s
    assert all(0 < r["server_busy_whole_run"] <= 1 and 0 <= r["server_busy"] <= 1 and r["step_s"] > 0 for r in record["rows"])


def test_same_seed_same_events_and_step_times(tmp_path):
    first = small_run(tmp_path / "a", seed=3, max_async_level=1)
    second = small_run(tmp_path / "b", seed=3, max_async_level=1)
    assert first.events == second.events and len(first.events) > 50
    assert first.step_end_s == second.step_end_s and first.shipped == second.shipped
    assert [r["time"] for r in first.records] == [r["time"] for r in second.records]
    other = small_run(tmp_path / "c", seed=4, max_async_level=1)
    assert other.events != first.events and other.step_end_s != first.step_end_s


def test_ordering_invariants_hold_at_1024_rollouts_a_step(tmp_path):
    lead, stale_bound, group_size, batch = 1, 1, 2, 512
    result = small_run(tmp_path, batch_size=batch, group_size=group_size, num_steps=3,
                       max_async_level=lead, max_off_policy_steps=stale_bound)  # fmt: skip
    assert result.steps == 3 and all(r["samples"] == 1024 for r in result.records)
    shipped_groups = {}
    for step, group, _, version, _ in result.shipped:
        shipped_groups.setdefault(step, set()).add(group)
        assert step - version <= stale_bound  # the staleness bound, queue time included
        assert version >= step - lead  # the lead gate at generation
    assert all(result.version_at_ship[step] >= step - lead for step in range(3))  # ... and at shipping
    scored = [group for group, _, _ in result.score_calls]
    assert len(scored) == len(set(scored)) == 3 * batch  # one score call per group...
    assert set(scored) == set().union(*shipped_groups.values())
    assert all(
        n == group_size and one_group for _, n, one_group in result.score_calls
    )  # ...with every branch
    order = [(kind, a) for _, kind, a, _ in result.events]
    for step in range(3):
        assert (
            order.index(("critic_grid", step))
            < order.index(("critic_trained", step))
            < order.index(("policy_grid", step))
        )
    for model in ("critic", "policy"):
        for step, per_rank in result.grid_micro_steps[model].items():
            assert len(per_rank) == 2 and len(set(per_rank)) == 1, (model, step, per_rank)
    times = [e[0] for e in result.events]
    assert times == sorted(times) and result.step_end_s[-1] > 60  # simulated minutes...
    assert result.wall_s < 60  # ...in seconds of wall time


def test_grpo_runs_without_a_critic(tmp_path):
    resolved = cluster_config(ROOT / "examples/configs/qwen3_30b_a3b_grpo.yaml", tmp_path, batch_size=4, group_size=8,
                              num_steps=2, max_completion_tokens=64, max_prompt_tokens=32)  # fmt: skip
    result = SimCluster(resolved, ClusterModel(**SHORT), run_dir=tmp_path).run()
    assert result.steps == 2 and result.score_calls == [] and "critic" not in result.grid_bytes
    assert [kind for _, kind, *_ in result.events if kind == "version_live"] == ["version_live"] * 2


def test_trainers_take_their_steps_in_order_when_grids_arrive_together(tmp_path):
    # max_async_level 2 ships steps 0-2 at about the same time: a smaller grid sent after a
    # bigger one is off the wire first, and must still be trained after it
    resolved = cluster_config(ROOT / "examples/configs/qwen3_30b_a3b_grpo.yaml", tmp_path, batch_size=4, group_size=8,
                              num_steps=5, max_completion_tokens=64, max_prompt_tokens=32, max_async_level=2,
                              max_off_policy_steps=2)  # fmt: skip
    result = SimCluster(resolved, ClusterModel(**SHORT), run_dir=tmp_path).run()
    trained = [a for _, kind, a, _ in result.events if kind == "policy_train_start"]
    live = [a for _, kind, a, _ in result.events if kind == "version_live"]
    assert trained == list(range(5)) and live == list(range(1, 6))
    shipped = [t for t, kind, *_ in result.events if kind == "policy_grid"]
    assert shipped[1] - shipped[0] < 1.0  # the grids did come together


def test_each_broadcast_delays_the_next_version_on_policy(tmp_path):
    quick = small_run(tmp_path / "quick", model=ClusterModel(**SHORT, broadcast_s=0.0), max_async_level=0)
    slow = small_run(tmp_path / "slow", model=ClusterModel(**SHORT, broadcast_s=500.0), max_async_level=0)
    # steps 1 and 2 wait for versions 1 and 2, each live one broadcast after its training
    assert slow.step_end_s[-1] - quick.step_end_s[-1] == pytest.approx(2 * 500, abs=1.0)


# Partial rollouts and finish order: completions of ~10 s at 100 tokens/s against 3 s broadcasts,
# so updates land in the middle of requests.
LONG = dict(prompt_tokens=16, completion_median_tokens=1000, completion_min_tokens=200, completion_sigma=0.8,
            broadcast_s=3.0)  # fmt: skip
FINISH = dict(batch_size=8, group_size=1, num_steps=5, max_completion_tokens=4000, max_async_level=1,
              max_off_policy_steps=1, batch_order="finish", oversample=8)  # fmt: skip


def one_request(tmp_path, mode: str, pause_at: float, pause_s: float, prompt: int, tokens: int):
    """One request of `prompt` + `tokens` tokens on one server, an update (to version 1) pausing it
    at `pause_at` for `pause_s`: (the completion, its end time, the server, the SimInference)."""
    model = ClusterModel(completion_median_tokens=tokens + 0.5, completion_sigma=0.0, completion_min_tokens=1)
    cluster = SimCluster(cluster_config(SAO, tmp_path), model, seed=0, run_dir=tmp_path)
    inference = SimInference(cluster, 1, mode)

    async def main():
        request = asyncio.ensure_future(
            inference.complete([0, 0, 5] + [7] * (prompt - 3), SamplingParams(max_tokens=4 * tokens), "group5-branch0")
        )
        await asyncio.sleep(pause_at)
        inference.pause(pause_at, pause_s, 1)
        completion = await request
        inference.servers[0].account()
        return completion, asyncio.get_running_loop().time()

    completion, end = run_virtual(main())
    return completion, end, inference.servers[0], inference


@pytest.mark.parametrize("mode", ["keep", "interrupt"])
def test_an_update_costs_a_reprefill_that_is_not_busy_time(tmp_path, mode):
    prompt, tokens, prefill, decode = 800, 500, 8000.0, 100.0  # the cluster model's default rates
    completion, end, server, inference = one_request(tmp_path, mode, pause_at=1.0, pause_s=2.0, prompt=prompt, tokens=tokens)
    before = int((1.0 - prompt / prefill) * decode)  # decoded when the update came: 90
    again = prompt + before
    assert end == pytest.approx(prompt / prefill + tokens / decode + 2.0 + again / prefill)
    assert server.busy_s == pytest.approx(prompt / prefill + tokens / decode)  # neither pause nor re-prefill
    assert server.reprefill_s == pytest.approx(again / prefill)
    assert inference.reprefilled_tokens == {1: pytest.approx(again)}
    assert len(completion.token_ids) == tokens and completion.finish_reason == "stop"
    if mode == "keep":  # one version: the one it was sent under
        assert completion.token_versions is None and completion.policy_version == 0 and completion.interruptions == 0
    else:  # each token the version that sampled it, as RolloutClient joins the parts
        assert completion.token_versions == [0] * before + [1] * (tokens - before)
        assert completion.interruptions == 1 and completion.reprefilled_tokens == again
        assert completion.policy_version == 0


def test_under_interrupt_every_token_was_sampled_while_its_version_was_live(tmp_path):
    result = small_run(tmp_path, model=ClusterModel(**LONG), settings={"inference.update_mode": "interrupt"}, **FINISH)
    assert result.steps == FINISH["num_steps"] and result.updates
    spanning = [(g, old, new) for _, g, _, old, new in result.shipped if new > old]
    assert spanning and sum(r["samples_spanning_versions"] for r in result.records) == len(spanning)
    assert sum(r["interruptions"] for r in result.records) > 0
    live = [(0, float("-inf"), float("inf"))]  # (version, from, until): between the updates' pauses
    for update in result.updates:
        live[-1] = (live[-1][0], live[-1][1], update.start)
        live.append((update.version, update.end, float("inf")))
    versions_of = {}
    for group, version, start, end, tokens in result.parts:
        assert tokens > 0 and any(v == version and a <= start and end <= b for v, a, b in live), (version, start, end)
        versions_of.setdefault(group, set()).add(version)
    for _, group, _, oldest, newest in result.shipped:  # what the samples carry is what the servers did
        if group in versions_of:
            assert (oldest, newest) == (min(versions_of[group]), max(versions_of[group]))
        else:  # never interrupted
            assert oldest == newest


def test_finish_order_with_oversample_keeps_the_staleness_bound_and_counts_the_waste(tmp_path):
    result = small_run(tmp_path, model=ClusterModel(**LONG), **FINISH)
    assert result.steps == FINISH["num_steps"] and all(r["samples"] == 8 for r in result.records)
    assert all(step - oldest <= FINISH["max_off_policy_steps"] for step, _, _, oldest, _ in result.shipped)
    stale = sum(r["stale_dropped"] for r in result.records)
    assert stale > 0 and len(result.wasted_groups) == stale  # the bound did bite: what was dropped is the waste
    assert result.wasted_tokens > 0 and result.reprefilled_tokens  # keep mode re-prefills after each update
    assert all(r["version_span_max"] == 0 for r in result.records)  # keep: one version a completion
    assert max(result.true_version_spans) > 0  # ... though an update came in the middle of some
    groups = [g for r in result.records for g in r["group_ids"]]
    assert groups != sorted(groups)  # batches in the order groups finished


@pytest.mark.parametrize("mode", ["keep", "interrupt"])
def test_same_seed_same_events_under_either_update_mode(tmp_path, mode):
    settings = {"inference.update_mode": mode}
    first = small_run(tmp_path / "a", seed=2, model=ClusterModel(**LONG), settings=settings, **FINISH)
    second = small_run(tmp_path / "b", seed=2, model=ClusterModel(**LONG), settings=settings, **FINISH)
    assert first.events == second.events and first.shipped == second.shipped and first.parts == second.parts
    assert first.reprefilled_tokens == second.reprefilled_tokens and first.step_end_s == second.step_end_s


def test_virtual_clock_jumps_sleeps_runs_threads_inline_and_names_a_deadlock():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(300)
        value = await asyncio.to_thread(lambda: 7)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(1000), 10)
        return loop.time(), value

    assert run_virtual(main()) == (310.0, 7)

    async def stuck():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationDeadlock, match="no timer scheduled"):
        run_virtual(stuck(), idle_wall_s=0.1)


def test_flops_model_against_the_published_size_and_a_plain_count(tmp_path):
    arch = cluster_config(SAO, tmp_path).model.architecture
    # Qwen3-30B-A3B: 3.3B activated parameters (the model card), embeddings included
    assert active_parameters(arch, True) + arch.hidden_size * arch.vocab_size == pytest.approx(
        3.3e9, rel=0.03
    )
    # one sequence: 2 x params per token, and causal attention counted token by token (token t
    # attends to t + 1 keys: QK^T and AV, 2 x heads x head_dim FLOPs per key each)
    n, heads, d = 3000, arch.num_attention_heads, arch.kv_channels
    attention = arch.num_layers * sum(2 * 2 * heads * d * (t + 1) for t in range(n))
    reference = 2 * active_parameters(arch, False) * n + attention
    assert forward_flops(arch, [n], False) == pytest.approx(reference, rel=1e-3)
    assert forward_flops(arch, [n, 10], False) == pytest.approx(
        forward_flops(arch, [n], False) + forward_flops(arch, [10], False)
    )


def test_bad_inputs_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="decode_tokens_per_s must be > 0"):
        ClusterModel(decode_tokens_per_s=0).check()
    with pytest.raises(ValueError, match="seed_step_s_high"):
        ClusterModel(seed_step_s_low=10, seed_step_s_high=5).check()
    with pytest.raises(ValueError, match=r"unknown orchestrator keys \['batchsize'\]"):
        cluster_config(SAO, tmp_path, batchsize=4)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

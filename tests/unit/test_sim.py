"""The simulated cluster (megatron_rl/sim/cluster.py): the real orchestrator against stand-ins on
a virtual clock. A small run of benchmarks/scale.py (so the benchmark cannot rot); the same seed
gives the same events at the same simulated times; at 1,024 rollouts a step the orchestrator's
ordering invariants hold (one score call per group with every branch, critic grid and critic
trained before the policy grid, the staleness bound, the lead gate, every data rank with the
same micro-steps); the virtual clock and the models' inputs."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_rl.sim.cluster import SimCluster, cluster_config
from megatron_rl.sim.models import ClusterModel, active_parameters, forward_flops
from megatron_rl.sim.virtual_clock import SimulationDeadlock, run_virtual

ROOT = Path(__file__).resolve().parents[2]
SAO = ROOT / "examples/configs/qwen3_30b_a3b_sao.yaml"
SHORT = dict(prompt_tokens=16, completion_median_tokens=24, completion_min_tokens=4, completion_sigma=0.8)


def small_run(tmp_path, seed=0, model=None, **orchestrator):
    settings = dict(batch_size=8, group_size=2, num_steps=3, max_completion_tokens=64, max_prompt_tokens=32)
    resolved = cluster_config(SAO, tmp_path, **(settings | orchestrator))
    return SimCluster(resolved, model or ClusterModel(**SHORT), seed=seed, run_dir=tmp_path).run()


def test_the_scale_benchmark_runs_small(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "benchmarks/scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "scale.json"
    argv = ["--sizes", "4,8", "--steps", "2", "--async-steps", "3", "--prompt-tokens", "16",
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
    for step, group, _, version in result.shipped:
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

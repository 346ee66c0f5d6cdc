"""The critic's training options on gloo ranks: head-only warmup, attention freezing, LoRA,
value pretraining, dummy-only data ranks, policy snapshots across layouts, checkpoint resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.config import load_resolved
from megatron_rl.data.packing import dummy_micro_batch, pack_into_grid
from tests.support.critic import critic_config
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks
from tests.support.tools import run_tools

HEAD = ("value_head.bias", "value_head.weight")


def test_head_only_warmup_then_full_training_with_fresh_adam_state(tiny_models, tmp_path):
    resolved, path = critic_config(
        tmp_path, tiny_models["qwen3"], head_only_warmup_steps=2, epochs_per_step=2
    )
    warm0, warm1, full, saved = run_ranks(
        critic_plan, 1, str(path), [("train", 0, 0), ("train", 1, 1), ("train", 2, 2), ("save",)]
    )[0]
    for record in (warm0, warm1):
        assert record["head_only"] and tuple(record["changed"]) == HEAD
        assert len(record["epoch_losses"]) == 2 and record["epoch_losses"][1] < record["epoch_losses"][0]
    assert warm1["adam_steps"] == {"head": [4], "backbone": [4]}  # frozen steps count in Adam...
    assert not full["head_only"]
    assert (
        "decoder.layers.0.self_attention.linear_qkv.weight" in full["changed"] and len(full["changed"]) > 10
    )
    # ...and restart at 0 when the backbone starts training: 2 real steps now, the head 6
    assert full["adam_steps"] == {"head": [6], "backbone": [2]}
    # A checkpoint needs one step count (megatron's distributed optimizer stores one): unified.
    # (Saving failed here before, inside megatron's DistributedOptimizer.state_dict.)
    assert saved["adam_steps"] == {"head": [6], "backbone": [6]}


def test_freeze_attention_trains_everything_else(tiny_models, tmp_path):
    resolved, path = critic_config(tmp_path, tiny_models["qwen3"], freeze_attention=True)
    (record,) = run_ranks(critic_plan, 1, str(path), [("train", 0, 0)])[0]
    assert record["changed"] and not [n for n in record["changed"] if ".self_attention." in n]
    assert set(HEAD) <= set(record["changed"])
    assert "decoder.layers.1.mlp.linear_fc1.weight" in record["changed"]


def test_lora_at_tp2_trains_adapters_and_head_and_checkpoints(tiny_models, tmp_path):
    lora = {"rank": 4, "alpha": 8.0}
    resolved, path = critic_config(tmp_path, tiny_models["qwen3"], world=2, tp=2, lora=lora)
    trained, _ = run_ranks(critic_plan, 2, str(path), [("train", 0, 0), ("save",)])[0]
    assert trained["changed"]
    assert all(".lora_" in n or n in HEAD for n in trained["changed"])
    # B starts at zero, so the first step moves B (and the head) but A's gradient is still zero
    assert any(".lora_b" in n for n in trained["changed"]) and set(HEAD) <= set(trained["changed"])
    # the checkpoint holds what trains (adapters and head) and names the frozen base instead
    from megatron_rl.conversion.spec_keys import checkpoint_keys

    dist = Path(_latest_dist(tmp_path))
    model_keys = {k for k in checkpoint_keys(dist) if not k.startswith("optimizer.")}
    assert model_keys and all(k.endswith((".lora_a", ".lora_b")) or k.startswith("value_head.") for k in model_keys)
    assert set(HEAD) <= model_keys
    base = json.loads((dist.parent / "meta.json").read_text())["lora"]["base"]
    assert base["where"] == "value.model.checkpoint" and base["checkpoint"] == str(tiny_models["qwen3"].absolute())
    assert base["fingerprint"].startswith("sha256:")
    resumed, params = run_ranks(critic_plan, 2, str(path), [("resume",), ("params",)])[0]
    assert resumed["trained_step"] == 0
    # the base from value.model.checkpoint, the adapters and head from the checkpoint: exactly as trained
    assert set(params["full"]) == set(trained["full"])
    for name, value in trained["full"].items():
        torch.testing.assert_close(params["full"][name], value, rtol=0, atol=0)
    # merged HF weights of the step (export-lora --merged): the base with the adapters folded in, the trained head
    from safetensors.torch import load_file

    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.transforms.lora import merge_adapter_tensors

    run_ranks(merged_export, 1, str(dist.parent), str(tmp_path / "merged"), str(tiny_models["qwen3"]))
    exported = load_file(tmp_path / "merged" / "model.safetensors")
    expected = megatron_to_hf(merge_adapter_tensors(trained["full"], lora["alpha"]), resolved.layout.critic_architecture,
                              value_model=True)  # fmt: skip
    assert sorted(exported) == sorted(expected) and "value_head.weight" in exported
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_lora_on_an_moe_critic_at_tp2_sequence_parallel_equals_one_process(tiny_models, tmp_path):
    """value.lora on every linear of an MoE critic (expert adapters: one linear per expert) at
    TP = 2, where the critic runs sequence parallel and the experts are sharded over expert-TP = 2:
    two steps give one process's value losses and parameters."""
    lora = {"rank": 4, "alpha": 8.0}
    plan = [("train", 0, 0), ("train", 1, 1)]
    results = {}
    for world in (1, 2):
        _, path = critic_config(tmp_path / f"tp{world}", tiny_models["qwen3_moe"], world=world, tp=world, lora=lora)
        results[world] = run_ranks(critic_plan, world, str(path), plan)
    (one,), tp2 = results[1], results[2]
    assert any(".local_experts.0.linear_fc1.lora_b" in n for n in one[1]["changed"])  # the experts' adapters train
    for ranks in tp2:
        for record, expected in zip(ranks, one, strict=True):
            assert record["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)
            assert sorted(record["full"]) == sorted(expected["full"])
            for name, value in expected["full"].items():
                torch.testing.assert_close(record["full"][name], value, rtol=0, atol=2e-5, msg=name)


def merged_export(rank, world_size, step_dir, out, hf_dir):
    from megatron_rl.transforms.lora_export import export_merged

    return export_merged(Path(step_dir), Path(out), Path(hf_dir))


def _latest_dist(tmp_path):
    root = tmp_path / "checkpoints" / "critic"
    return str(root / (root / "latest").read_text().strip() / "dist")


def test_value_pretraining_from_jsonl_lowers_the_loss(tiny_models, tmp_path):
    rng = np.random.default_rng(0)
    with open(tmp_path / "values.jsonl", "w") as f:
        for i in range(8):
            n = int(rng.integers(8, 30))
            mask = [0] * 4 + [1] * (n - 4)
            record = {"token_ids": rng.integers(0, 500, n).tolist(), "loss_mask": mask}
            record["reward" if i % 2 else "returns"] = 1.0 if i % 2 else [0.5] * n
            f.write(json.dumps(record) + "\n")
    resolved, path = critic_config(
        tmp_path,
        tiny_models["qwen3"],
        pretrain_jsonl=str(tmp_path / "values.jsonl"),
        pretrain_steps=8,
        pretrain_batch_size=8,  # the whole file every step: each loss is on the same data
    )
    records = run_ranks(critic_plan, 1, str(path), [("pretrain",)] * 8)[0]
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(8)) and records[0]["phase"] == "pretrain"
    assert losses[-1] < 0.3 * losses[0], losses


def test_dummy_only_data_rank_contributes_nothing(tiny_models, tmp_path):
    resolved, path = critic_config(tmp_path / "dp2", tiny_models["qwen3"], world=2)
    samples = training_samples(5, resolved.layout.critic_architecture.vocab_size, seed=4)
    (real,) = pack_into_grid(samples, 64, 1)
    grid = [real, [dummy_micro_batch()] * len(real)]
    ranks = run_ranks(critic_plan, 2, str(path), [("train_grid", 0, grid)])
    resolved1, path1 = critic_config(tmp_path / "dp1", tiny_models["qwen3"], world=1)
    (single,) = run_ranks(critic_plan, 1, str(path1), [("train_grid", 0, [real])])[0]
    (rank0,), (rank1,) = ranks
    assert rank0["loss"] == pytest.approx(single["loss"], rel=1e-6)
    for name, value in single["full"].items():
        torch.testing.assert_close(rank0["full"][name], value, rtol=0, atol=2e-6)
        torch.testing.assert_close(rank1["full"][name], rank0["full"][name], rtol=0, atol=0)


def test_snapshot_from_policy_at_tp2_loads_into_critic_at_cp2_then_retunes_head(tiny_models, tmp_path):
    snapshots, policy_checkpoints = tmp_path / "snapshots", tmp_path / "policy_checkpoints"
    resolved, path = critic_config(
        tmp_path,
        tiny_models["qwen3"],
        world=2,
        cp=2,
        snapshot={"steps": [1], "dir": str(snapshots), "head_only_retune_steps": 1, "wait_timeout_s": 60},
    )
    arch = resolved.layout.policy_architecture
    policy = run_ranks(policy_snapshot, 2, arch, 2, 11, str(snapshots), str(policy_checkpoints))[0]
    step_dir = policy_checkpoints / (policy_checkpoints / "latest").read_text().strip()
    plan = [("train", 0, 0), ("train", 1, 1), ("train", 2, 2), ("load_backbone", str(step_dir / "dist"))]
    before, retuned, full, from_checkpoint = run_ranks(critic_plan, 2, str(path), plan)[0]
    assert not before["head_only"] and retuned["head_only"] and not full["head_only"]
    backbone = [n for n in policy if n != "output_layer.weight"]
    assert set(backbone) == {n for n in retuned["full"] if not n.startswith("value_head.")}
    for name in backbone:  # the policy's weights, unchanged by the head-only retune step
        torch.testing.assert_close(retuned["full"][name], policy[name], rtol=0, atol=0)
    assert any(not torch.equal(retuned["full"][n], before["full"][n]) for n in HEAD)
    assert len(full["changed"]) > 10  # full training again after the retune step
    for name in backbone:  # a policy *training* checkpoint (TP=2) loads the same way
        torch.testing.assert_close(from_checkpoint["full"][name], policy[name], rtol=0, atol=0)


def _with_value_options(path: Path, **optimizer_and_model) -> None:
    """Edits a resolved config's value section in place: `cpu_offload` goes to value.optimizer,
    `dtype` to value.model (cpu_offload is refused for CPU deployments when a config is loaded;
    the rank function below emulates the hybrid optimizer's host copies instead)."""
    resolved = json.loads(path.read_text())
    for key, value in optimizer_and_model.items():
        resolved["value"]["optimizer" if key == "cpu_offload" else "model"][key] = value
    path.write_text(json.dumps(resolved))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_snapshot_loaded_into_an_offloaded_critic_is_what_its_next_step_trains(
    tiny_models, tmp_path, dtype
):
    """The policy snapshot of step 1 is loaded, then a full step trains (no head-only retune): with
    the optimizer offloaded (megatron's hybrid optimizer, its host copies emulated on CPU) the
    weights after that step are the non-offloaded critic's, i.e. the snapshot plus one update.
    Before, the step started from the optimizer's copies of the old weights (the hybrid optimizer
    refreshed only its fp32 copies of 16-bit parameters; the distributed optimizer's fp32 masters
    lived outside it) and wrote them back: the snapshot was discarded."""
    snapshots = tmp_path / "snapshots"
    finals = {}
    for offload in (False, True):
        resolved, path = critic_config(
            tmp_path / f"offload_{offload}",
            tiny_models["qwen3"],
            snapshot={"steps": [1], "dir": str(snapshots), "head_only_retune_steps": 0, "wait_timeout_s": 60},
        )
        _with_value_options(path, cpu_offload=offload, dtype=dtype)
        if not offload:
            arch = resolved.layout.policy_architecture
            policy = run_ranks(policy_snapshot, 1, arch, 1, 11, str(snapshots), str(tmp_path / "policy"))[0]
        before, after = run_ranks(critic_plan, 1, str(path), [("train", 0, 0), ("train", 1, 1)])[0]
        assert not after["head_only"] and len(after["changed"]) > 10
        finals[offload] = after["full"]
    backbone = [n for n in policy if n != "output_layer.weight"]
    moved = max((finals[False][n].float() - before["full"][n].float()).abs().max().item() for n in backbone)
    assert moved > 0.005  # the snapshot is far from the critic's own weights ...
    for name in backbone:  # ... and one lr-1e-3 Adam step from the weights both critics end with
        off, on = finals[False][name].float(), finals[True][name].float()
        assert (off - policy[name].float()).abs().max().item() < 2.5e-3, name
        torch.testing.assert_close(on, off, rtol=0, atol=1e-6 if dtype == "float32" else 0)


def test_resume_continues_with_identical_next_step_loss(tiny_models, tmp_path):
    resolved, path = critic_config(tmp_path, tiny_models["qwen3"], world=2, epochs_per_step=2)
    straight = run_ranks(critic_plan, 2, str(path), [("train", s, s) for s in range(3)])[0]
    *_, saved = run_ranks(critic_plan, 2, str(path), [("train", 0, 0), ("train", 1, 1), ("save",)])[0]
    resumed, step2 = run_ranks(critic_plan, 2, str(path), [("resume",), ("train", 2, 2)])[0]
    assert resumed["trained_step"] == 1
    assert step2["epoch_losses"] == straight[2]["epoch_losses"]  # exactly, on CPU
    # The value-head flag stays on the head's groups (megatron's load matched groups by their
    # lr/wd multipliers only and moved it onto a backbone group).
    assert resumed["groups"] == saved["groups"] == straight[0]["groups"]
    assert sorted(flag for flag, _, _ in resumed["groups"]) == [False, False, True, True]


def test_pipeline_parallel_critic_trains_like_one_process(tiny_models, tmp_path):
    resolved, path = critic_config(tmp_path / "pp2", tiny_models["qwen3"], world=2, pp=2, epochs_per_step=2)
    assert resolved.layout.critic.pp == 2 and resolved.layout.critic.dp == 1
    stages = run_ranks(critic_plan, 2, str(path), [("train", 0, 0)])
    _, path1 = critic_config(tmp_path / "pp1", tiny_models["qwen3"], world=1, epochs_per_step=2)
    (single,) = run_ranks(critic_plan, 1, str(path1), [("train", 0, 0)])[0]
    (first,), (last,) = stages
    assert first["epoch_losses"] == pytest.approx(single["epoch_losses"], rel=1e-5)
    merged = {**first["full"], **last["full"]}  # each stage holds its own layers
    assert set(merged) == set(single["full"])
    for name, value in single["full"].items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=2e-6)


def test_critic_starts_from_hf_or_converted_checkpoints_at_tp2(tiny_models, tmp_path):
    hf_dir = tiny_models["qwen3"]
    converted = run_tools(
        ("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", tmp_path / "gpt"),
        ("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", tmp_path / "critic", "--value-model",
         "--head-init-std", "0.3"),
    )  # fmt: skip
    assert all(done.returncode == 0 for done in converted), [done.stderr[-1500:] for done in converted]
    full = {}
    for name, checkpoint in [("hf", hf_dir), ("gpt", tmp_path / "gpt"), ("critic", tmp_path / "critic")]:
        _, path = critic_config(tmp_path / f"run_{name}", hf_dir, world=2, tp=2)
        config = json.loads(path.read_text())
        config["value"]["model"]["checkpoint"] = str(checkpoint)
        path.write_text(json.dumps(config))
        (record,) = run_ranks(critic_plan, 2, str(path), [("params",)])[0]
        full[name] = record["full"]
    saved = run_ranks(converted_parameters, 1, str(tmp_path / "critic"))[0]
    for name, value in full["hf"].items():
        torch.testing.assert_close(full["gpt"][name], value, rtol=0, atol=0)  # same backbone and head init
        expected = saved[name]  # the converted critic: backbone and its own head
        torch.testing.assert_close(full["critic"][name], expected, rtol=0, atol=0)
    assert not torch.equal(full["critic"]["value_head.weight"], full["hf"]["value_head.weight"])


def test_snapshot_from_a_moe_policy_at_ep2_loads_into_a_one_rank_critic(tiny_models, tmp_path):
    snapshots = tmp_path / "snapshots"
    resolved, path = critic_config(
        tmp_path,
        tiny_models["qwen3_moe"],
        world=1,
        snapshot={"steps": [1], "dir": str(snapshots), "wait_timeout_s": 60},
    )
    arch = resolved.layout.policy_architecture
    assert arch.num_experts > 1
    ranks = run_ranks(policy_snapshot, 2, arch, 1, 5, str(snapshots), str(tmp_path / "policy_ckpt"), 2)
    policy = {**ranks[0], **ranks[1]}  # each EP rank holds its own experts
    _, loaded = run_ranks(
        critic_plan,
        1,
        str(path),
        [("train", 0, 0), ("load_backbone", str(snapshots / "version_00000001" / "dist"))],
    )[0]
    backbone = [n for n in policy if n != "output_layer.weight"]
    assert any(".experts." in n for n in backbone)
    assert set(backbone) == {n for n in loaded["full"] if not n.startswith("value_head.")}
    for name in backbone:
        torch.testing.assert_close(loaded["full"][name], policy[name], rtol=0, atol=0)


# Rank functions: module-level, so that the spawned ranks can import them.


def _named(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _adam_steps(trainer) -> dict[str, list[int]]:
    """Adam step counts of the head groups and of the other groups."""
    from megatron_rl.trainer.optimizer import HEAD_GROUP_KEY, torch_optimizers

    steps = {"head": set(), "backbone": set()}
    for opt in torch_optimizers(trainer.trainable.optimizer):
        for group in opt.param_groups:
            kind = "head" if group.get(HEAD_GROUP_KEY) else "backbone"
            for p in group["params"]:
                state = opt.state.get(p)
                if state and "step" in state:
                    steps[kind].add(int(state["step"]))
    return {k: sorted(v) for k, v in steps.items()}


def _groups(trainer) -> list[tuple[bool, int, float]]:
    """Per optimizer group: whether it is a value-head group, its parameter count, wd_mult."""
    from megatron_rl.trainer.optimizer import HEAD_GROUP_KEY, torch_optimizers

    return [
        (bool(group.get(HEAD_GROUP_KEY)), len(group["params"]), group["wd_mult"])
        for opt in torch_optimizers(trainer.trainable.optimizer)
        for group in opt.param_groups
    ]


def critic_plan(rank, world_size, resolved_path, plan):
    """Builds a CriticTrainer from a resolved config and runs `plan` on it, recording after each
    action what changed, so one spawn checks a whole scenario:
        ("train", step, seed)         train `step` on 7 synthetic samples packed for this layout
        ("train_grid", step, grid)    train `step` on grid[data_rank] (a grid built by the test)
        ("pretrain",)                 one value-pretraining step
        ("save",) / ("resume",)       critic checkpoint
        ("load_backbone", dist_dir)   load a backbone from a dist checkpoint directory
        ("params",)                   just record the full parameters
    """
    from megatron_rl.critic.trainer import CriticTrainer
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters

    resolved = load_resolved(resolved_path)
    if resolved.value.optimizer.cpu_offload and not torch.cuda.is_available():
        from tests.support import host_offload

        host_offload.install()
    trainer = CriticTrainer(resolved)
    vocab = trainer.arch.vocab_size
    records = []
    for action in plan:
        before = _named(trainer.model)
        record = {"action": action[0]}
        if action[0] == "train":
            _, step, seed = action
            samples = training_samples(7, vocab, seed=seed)
            grid = pack_into_grid(
                samples,
                trainer.value.model.seq_len,
                trainer.dp,
                trainer.cp,
                sequence_parallel_size=trainer.sp,
            )
            record.update(trainer.train(step, grid[trainer.data_rank]))
        elif action[0] == "train_grid":
            _, step, grid = action
            record.update(trainer.train(step, grid[trainer.data_rank]))
        elif action[0] == "pretrain":
            record.update(trainer.pretrain_step(trainer.pretrain_steps_done))
        elif action[0] == "save":
            trainer.save(trainer.trained_step)
        elif action[0] == "resume":
            from megatron_rl.trainer.resume import complete_steps

            steps = complete_steps(
                trainer.checkpoint_dir
            )  # a critic trained without a policy: its own latest
            meta = trainer.resume(steps[-1]) if steps else None
            record["step"] = None if meta is None else meta["step"]
            record["trained_step"] = trainer.trained_step
        elif action[0] == "params":
            pass
        elif action[0] == "load_backbone":
            from megatron_rl.trainer.weights import load_backbone

            load_backbone(trainer.model, action[1])
        after = _named(trainer.model)
        record["changed"] = sorted(n for n in after if not torch.equal(after[n], before[n]))
        record["adam_steps"] = _adam_steps(trainer)
        record["groups"] = _groups(trainer)
        record["full"] = (
            gather_full_parameters(trainer.model)
            if action[0] in ("train", "train_grid", "load_backbone", "params")
            else None
        )
        records.append(record)
    return records


def policy_snapshot(rank, world_size, arch, tp, seed, snapshot_root, checkpoint_root, ep=1):
    """A policy GPT model at TP = tp (EP = ep) with random weights: exports snapshot version 1
    and a training checkpoint; returns its full parameters (this rank's experts)."""
    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import dummy_micro_batch
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.snapshot import export_snapshot
    from megatron_rl.trainer.step import train_step

    parallel.initialize_model_parallel(tp=tp, ep=ep, seed=seed)
    torch.manual_seed(seed)
    model = build_gpt_model(arch, tp=tp, ep=ep)
    with torch.no_grad():
        for p in model.parameters():  # distinct from the critic's HF initialisation
            p.add_(0.01 * torch.randn_like(p))
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3), total_steps=1)
    # One step on a dummy micro-batch: Adam state exists (a checkpoint needs it), weights unchanged.
    loss = policy_loss_func(AlgorithmConfig(type="grpo"))
    train_step(trainable, [dummy_micro_batch()], loss)
    export_snapshot(model, snapshot_root, version=1, info={"tp": tp})
    save_checkpoint(checkpoint_root, 0, trainable)
    return gather_full_parameters(model)


def converted_parameters(rank, world_size, checkpoint_dir):
    """Full parameters of a converted checkpoint (tools/convert_hf_to_megatron.py)."""
    from megatron_rl.conversion.convert import load_checkpoint_full

    return load_checkpoint_full(checkpoint_dir)[2]

"""Rank functions for the critic training tests (run with megatron_rl.testing.spawn.run_ranks).

`critic_plan` builds a CriticTrainer from a resolved config and runs a list of actions on it,
recording after each what changed, so one spawn checks a whole scenario:
    ("train", step, seed)         train `step` on 7 synthetic samples packed for this layout
    ("train_grid", step, grid)    train `step` on grid[data_rank] (a grid built by the test)
    ("pretrain",)                 one value-pretraining step
    ("save",) / ("resume",)       critic checkpoint
    ("load_backbone", dist_dir)   load a backbone from a dist checkpoint directory
    ("params",)                   just record the full parameters
"""

from __future__ import annotations

import torch

from megatron_rl.config import load_resolved
from tests.distributed.megatron_workers import training_samples


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
    from megatron_rl.critic.trainer import CriticTrainer
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters

    resolved = load_resolved(resolved_path)
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

            steps = complete_steps(trainer.checkpoint_dir)  # a critic trained without a policy: its own latest
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
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.snapshot import export_snapshot
    from megatron_rl.trainer.step import policy_loss_func, train_step

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
    from megatron_rl.models.convert import load_checkpoint_full

    return load_checkpoint_full(checkpoint_dir)[2]


def critic_with_failing_scores(rank, world_size, resolved_path):
    """`run_critic` on every rank, with scoring made to fail twice: on every rank while packing a
    batch that holds a 13-token sequence (a deterministic failure), and on rank 1 only after
    the collectives of the third scoring call. Rank 0 also runs the client in a thread and
    returns [(status, reply)] for its requests; afterwards it stops the critic with SIGTERM."""
    import json
    import os
    import signal
    import threading
    import time

    import httpx

    from megatron_rl.critic import scoring, worker
    from megatron_rl.critic.trainer import CriticTrainer
    from megatron_rl.data.packing import PackingError

    original_pack, original_score = scoring.pack_into_grid, CriticTrainer.score
    calls = {"n": 0}

    def pack(samples, *args, **kwargs):
        if any(len(s.token_ids) == 13 for s in samples):
            raise PackingError("injected: a 13-token sequence")
        return original_pack(samples, *args, **kwargs)

    def score(self, request):
        result = original_score(self, request)
        calls["n"] += 1
        if calls["n"] == 2 and rank == 1:  # the third request (the second was refused while packing)
            raise RuntimeError("injected: rank 1 fails after its collectives")
        return result

    scoring.pack_into_grid, CriticTrainer.score = pack, score
    resolved = load_resolved(resolved_path)
    url = f"http://{resolved.value.service.host}:{resolved.value.service.port}"
    replies = []

    def client():
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for batch in ([[1, 2, 3]], [[5] * 13, [6]], [[7, 8]], [[9, 10, 11]]):
            reply = httpx.post(f"{url}/score", content=json.dumps({"batched_token_ids": batch}), timeout=60)
            replies.append((reply.status_code, reply.json()))
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True) if rank == 0 else None
    if thread is not None:
        thread.start()
    worker.run_critic(resolved)
    if thread is not None:
        thread.join(timeout=30)
    return replies

"""Process groups for one role (policy or critic), owned by megatron's `parallel_state`.

`initialize_role(resolved, role)` reads the layout the config layer derived; nothing here
re-derives DP sizes. The default process group comes from torchrun's environment
(MASTER_ADDR/PORT, RANK, WORLD_SIZE) on NCCL with CUDA and gloo without, with the
configured `deployment.collective_timeout_s`; every rank of a role also runs a heartbeat
watchdog (watchdog.py) so that a lost rank ends its whole group, named, within
`deployment.heartbeat_timeout_s`. A role marks a normal end with `finished()` before `destroy()`.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Literal

import megatron_rl.compat as compat  # megatron-core on CPU needs its patches first

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_rl.config import Layout, ModelLayout, ResolvedConfig
from megatron_rl.parallel.watchdog import PeerWatchdog, store_owner
from megatron_rl.ports import free_port  # noqa: F401  (where callers import it from)

Role = Literal["policy", "critic"]
log = logging.getLogger("megatron_rl.parallel")




def role_layout(layout: Layout, role: Role) -> ModelLayout:
    """The model layout of `role` (`layout.policy` or `layout.critic`)."""
    model_layout = layout.policy if role == "policy" else layout.critic
    if model_layout is None:
        raise ValueError(f"role '{role}' has no layout in this config (a GRPO config has no critic)")
    return model_layout


def initialize_distributed(timeout_s: float = 600.0) -> None:
    """Initialises torch.distributed from the environment unless already initialised."""
    if dist.is_initialized():
        return
    if not compat.CPU_MODE:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=compat.distributed_backend(), timeout=timedelta(seconds=timeout_s))


def initialize_model_parallel(tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1234) -> None:
    """Creates megatron's TP/CP/PP/EP/DP groups on the initialised default group and seeds RNGs."""

    if dist.get_world_size() % (tp * cp * pp):
        raise ValueError(f"world size {dist.get_world_size()} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


_watchdog = None  # this process's PeerWatchdog, while its role runs


def initialize_role(resolved: ResolvedConfig, role: Role, seed: int = 1234) -> ModelLayout:
    """Default group from the environment, then megatron groups with this role's layout; starts
    the lost-rank watchdog."""
    layout = role_layout(resolved.layout, role)
    deployment = resolved.deployment
    initialize_distributed(timeout_s=deployment.collective_timeout_s)
    start_watchdog(role, deployment.heartbeat_timeout_s)
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"{role}: started with {dist.get_world_size()} ranks but the resolved layout needs {layout.world_size}"
        )
    initialize_model_parallel(tp=layout.tp, cp=layout.cp, pp=layout.pp, ep=layout.ep, seed=seed)
    return layout


_finished = False


def finished() -> None:
    """This rank's role ended normally: `destroy()` tells the peers, which then do not count its
    exit as a loss."""
    global _finished
    _finished = True


def start_watchdog(role: str, timeout_s: float) -> None:
    """Starts this rank's heartbeat watchdog on the default group's store (once; not for one rank)."""
    global _watchdog

    if _watchdog is None and dist.get_world_size() > 1:
        _watchdog = PeerWatchdog(
            role,
            dist.get_rank(),
            dist.get_world_size(),
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            timeout_s,
            store_owner(),
        ).start()


def stop_watchdog() -> None:
    """Ends the heartbeat. After a failure (no `finished()` first) it first waits a few
    heartbeats for a peer to go silent and logs which one was lost."""
    global _watchdog, _finished
    if _watchdog is not None:
        if not _finished:
            explanation = _watchdog.explain_failure()
            if explanation is not None:
                log.error("%s", explanation)
        _watchdog.stop(finished=_finished)
        _watchdog = None
    _finished = False


def destroy() -> None:
    """Stops the watchdog (see `stop_watchdog`), tears down megatron's groups and the default group."""

    stop_watchdog()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_device() -> torch.device:
    """Where tensors for collectives on the role's groups live: compat.device() (CUDA under
    NCCL, the CPU under gloo)."""
    return compat.device()


def any_rank(flag: bool, group=None) -> bool:
    """Whether `flag` is true on any rank of `group` (default: the whole role), by one all-reduce
    of a one-element tensor on the collective device; every rank gets the same answer."""
    if not dist.is_initialized():
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return bool(tensor.item())

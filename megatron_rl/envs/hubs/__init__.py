"""Environments written for a hub, trained and evaluated unchanged (`orchestrator.environment:
{hub: verifiers, ...}` or `{hub: openenv, ...}`; docs/environments/hubs.md). Each adapter is a
`DrivenEnvironment` (envs/base.py): the environment drives its own turns and reaches the policy
through our `ChatModel`, which renders its messages with our chat template and samples through
the rollout client, so the trained tokens are the sampled ones. The libraries are the `hubs`
extra (`pip install -e '.[hubs]'`; `scripts/ensure_venv.sh` installs it)."""

from __future__ import annotations

import importlib

from megatron_rl.envs.base import Environment

# hub -> (the adapter's module, its factory, the distribution it needs)
ADAPTERS = {
    "verifiers": ("megatron_rl.envs.hubs.verifiers", "make_verifiers_environment", "verifiers==0.4.0"),
    "openenv": ("megatron_rl.envs.hubs.openenv", "make_openenv_environment", "openenv-core==0.3.0"),
}


class HubUnavailable(ImportError):
    """The library a hub's adapter needs is not installed."""


def make_hub_environment(spec, dataset: str | None, seed: int, key: str, args: dict) -> Environment:
    """The environment `spec` (config/hubs.py) names, through its hub's adapter."""
    module_name, factory, requirement = ADAPTERS[spec.hub]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] in ("verifiers", "openenv"):
            raise HubUnavailable(
                f"{key}: hub {spec.hub!r} needs {requirement}, which is not installed ({error}); "
                "pip install -e '.[hubs]' (bash scripts/ensure_venv.sh installs it)"
            ) from error
        raise
    return getattr(module, factory)(spec, dataset=dataset, seed=seed, key=key, args=dict(args))

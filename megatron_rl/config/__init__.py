"""YAML -> validated config objects, and the derived layout every process reads.

`load_config(path)` validates a user's YAML and returns a `ResolvedConfig`: the config plus a
`layout` (DP sizes, GPU counts, ports, directories, seeds) derived here, once.
`ResolvedConfig.to_json()` is what the launcher writes for every process; `load_resolved(path)`
reads it back without deriving anything again. The package imports nothing of ours; the names of
the built-in algorithm parts are the registry's, which resolving a config reaches by its import
path (parts.py), as it reaches a plug-in.

    base.py          Strict models, ConfigError (every problem at once), secrets from the environment
    model.py         architecture, model, optimizer, LoRA (the policy's and the critic's)
    value.py         the critic's section
    algorithm.py     GRPO / PPO / SAO
    parts.py         the registry's built-in algorithm parts, reached by import path
    plugins.py       plug-ins by import path: loading them, checking their signatures
    orchestrator.py  rollouts, admission, dynamic sampling, overlong shaping, evaluation
    distillation.py  on-policy distillation: the teacher and its signal
    inference.py     the vLLM servers, the router, how weights reach them
    deployment.py    where each process group runs
    transport.py     the ZMQ channels to the trainers
    checkpoint.py    checkpoints and resuming
    logging.py       the run's directory, log levels, experiment tracking (W&B, TensorBoard)
    run.py           Config: all sections together
    validators.py    the cross-field rules, one named function each (RULES)
    layout.py        the derived layout and ResolvedConfig
    memory_plan.py   what each GPU holds; a plan that does not fit is a config error
    load.py          resolve, load_config, load_resolved, --set overrides
"""

from megatron_rl.config.algorithm import ALGORITHM_DEFAULTS, AlgorithmConfig
from megatron_rl.config.base import ConfigError, Strict, secret_from_env
from megatron_rl.config.checkpoint import CheckpointConfig
from megatron_rl.config.deployment import DeploymentConfig
from megatron_rl.config.distillation import DistillationConfig, TeacherConfig
from megatron_rl.config.inference import InferenceConfig
from megatron_rl.config.layout import Layout, ModelLayout, ResolvedConfig, RunPaths
from megatron_rl.config.load import apply_overrides, load_config, load_resolved, parse_config, resolve
from megatron_rl.config.logging import LoggingConfig, WandbConfig
from megatron_rl.config.model import (
    HF_MODEL_TYPES,
    LORA_TARGETS,
    Architecture,
    Family,
    LoraBase,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    PolicyLoraConfig,
    RecomputeConfig,
    adapts_experts,
    lora_serving,
)
from megatron_rl.config.orchestrator import (
    AdmissionConfig,
    DynamicSamplingConfig,
    EvalConfig,
    OrchestratorConfig,
    OverlongConfig,
)
from megatron_rl.config.run import Config
from megatron_rl.config.transport import TransportConfig
from megatron_rl.config.value import ServiceConfig, SnapshotConfig, ValueConfig

__all__ = [
    "ALGORITHM_DEFAULTS", "HF_MODEL_TYPES", "LORA_TARGETS", "AdmissionConfig", "AlgorithmConfig", "Architecture",
    "CheckpointConfig", "Config", "ConfigError", "DeploymentConfig", "DistillationConfig", "DynamicSamplingConfig", "EvalConfig", "Family",
    "InferenceConfig", "Layout", "LoggingConfig", "LoraBase", "LoraConfig", "ModelConfig", "ModelLayout",
    "OptimizerConfig", "PolicyLoraConfig", "OrchestratorConfig", "OverlongConfig", "RecomputeConfig", "ResolvedConfig", "RunPaths",
    "ServiceConfig", "SnapshotConfig", "Strict", "TeacherConfig", "TransportConfig", "ValueConfig", "WandbConfig", "apply_overrides",
    "adapts_experts", "load_config", "lora_serving", "load_resolved", "parse_config", "resolve", "secret_from_env",
]  # fmt: skip

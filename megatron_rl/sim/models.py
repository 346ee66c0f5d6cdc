"""The timing models of the simulated cluster (megatron_rl/sim/cluster.py): every parameter with
its default and meaning in one dataclass (`ClusterModel`; benchmarks/scale.py makes each a
flag), the FLOPs model of a configured model layout, and the stand-in tokenizer and environment
the real orchestrator runs against.

Defaults: the Qwen3-30B-A3B example configs (examples/configs/qwen3_30b_a3b_*.yaml; the
architecture, layouts, epochs and recomputation are read from the resolved config) and the
seed's measured critic steps and weight broadcast (`seed_*`, `broadcast_s`: they calibrate the
training throughput per GPU, for the critic and the policy alike, and the step-to-step spread).
The inference rates are chosen so that one batch's generation takes about as long as its
training on the SAO 30B layout at 64 rollouts, the regime where asynchrony pays. docs/scale.md
gives these figures and where they come from.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, fields

from megatron_rl.config import Architecture, ModelConfig
from megatron_rl.config.model_memory import latent_attention_parameters
from megatron_rl.envs import Environment, Turn


def _help(text: str, **kwargs):
    return field(metadata={"help": text}, **kwargs)


@dataclass
class ClusterModel:
    """What the stand-ins spend, in simulated seconds. Every field is a flag of benchmarks/scale.py."""

    # Inference servers (vLLM behind the router)
    num_servers: int = _help("inference servers; 0: the config's inference.num_servers", default=0)
    concurrency_per_server: int = _help(
        "requests one server runs at once (its KV cache); the rest queue", default=256
    )
    prefill_tokens_per_s: float = _help("prompt tokens per second of one request's prefill", default=8000.0)
    decode_tokens_per_s: float = _help("generated tokens per second of one running request", default=100.0)
    prompt_tokens: int = _help("tokens of every prompt (cut at orchestrator.max_prompt_tokens)", default=512)
    completion_median_tokens: float = _help("median completion length (lognormal)", default=3000.0)
    completion_sigma: float = _help("sigma of the lognormal completion length (the long tail)", default=0.9)
    completion_min_tokens: int = _help("shortest completion", default=1024)
    vocab_size: int = _help("token ids are drawn from [1, vocab_size); 0: the model's vocabulary", default=0)
    # Trainers: a FLOPs model calibrated on the seed's critic step
    seed_step_s_low: float = _help("fastest seed critic step (s)", default=227.0)
    seed_step_s_high: float = _help("slowest seed critic step (s)", default=773.0)
    seed_sequences: int = _help("sequences of the seed critic step", default=64)
    seed_tokens_per_sequence: int = _help("tokens per sequence of the seed critic step", default=31_000)
    seed_gpus: int = _help("GPUs of the seed critic", default=4)
    score_overhead_s: float = _help(
        "fixed cost of one /score request (HTTP, broadcast to the ranks, gather)", default=0.05
    )
    broadcast_s: float = _help(
        "one NCCL weight broadcast into the inference servers (they pause meanwhile)", default=48.7
    )
    wire_bytes_per_s: float = _help(
        "bytes per second of a grid on the wire (default: benchmarks/transport.py loopback)", default=704e6
    )

    @classmethod
    def flags(cls) -> list[tuple[str, type, object, str]]:
        """(name, type, default, help) of every field."""
        types = {"int": int, "float": float}
        return [(f.name, types[f.type], f.default, f.metadata["help"]) for f in fields(cls)]

    def check(self) -> None:
        """Raises ValueError naming the first parameter out of its range."""
        positive = ["concurrency_per_server", "prefill_tokens_per_s", "decode_tokens_per_s", "prompt_tokens",
                    "completion_median_tokens", "completion_min_tokens", "seed_step_s_low", "seed_step_s_high",
                    "seed_sequences", "seed_tokens_per_sequence", "seed_gpus", "wire_bytes_per_s"]  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster model: {name} must be > 0, got {getattr(self, name)}")
        for name in ("num_servers", "vocab_size", "completion_sigma", "score_overhead_s", "broadcast_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster model: {name} must be >= 0, got {getattr(self, name)}")
        if self.seed_step_s_high < self.seed_step_s_low:
            raise ValueError(
                f"cluster model: seed_step_s_high ({self.seed_step_s_high}) is below seed_step_s_low ({self.seed_step_s_low})"
            )


def active_parameters(arch: Architecture, lm_head: bool) -> float:
    """Parameters one token passes through (an MoE layer's: the routed top-k experts, the shared
    experts and the router; an MoE model's dense first layers: their MLP), plus the output layer
    when `lm_head` (the policy; a critic's value head is one column)."""
    h, d = arch.hidden_size, arch.kv_channels
    attention = h * arch.num_attention_heads * d * 2 + h * arch.num_key_value_heads * d * 2
    if arch.multi_latent_attention:
        attention = sum(latent_attention_parameters(arch, tp=1).values())
    dense_mlp = 3 * h * arch.intermediate_size
    moe_mlp = (arch.num_experts_per_tok * 3 * h * arch.moe_intermediate_size + h * arch.num_experts
               + 3 * h * arch.shared_expert_intermediate_size)  # fmt: skip
    moe_layers = len(arch.moe_layers)
    mlp = moe_layers * moe_mlp + (arch.num_layers - moe_layers) * dense_mlp
    return arch.num_layers * attention + mlp + (h * arch.vocab_size if lm_head else h)


def forward_flops(arch: Architecture, lengths, lm_head: bool) -> float:
    """FLOPs of one forward pass over packed sequences of `lengths` tokens: 2 x active parameters
    per token plus causal attention, layers x heads x (q/k head dim + v head dim) x n^2 per
    sequence (2 x head_dim where they are one)."""
    per_token = 2.0 * active_parameters(arch, lm_head)
    v_channels = arch.v_head_dim if arch.multi_latent_attention else arch.kv_channels
    attention = float(arch.num_layers * arch.num_attention_heads * (arch.kv_channels + v_channels))
    return sum(per_token * n + attention * n * n for n in lengths)


def training_passes(model_config: ModelConfig, epochs: int, extra_forwards: int = 0) -> int:
    """Forward-equivalents of a training step: 3 per epoch (forward, backward = 2 forwards), one
    more with full recomputation, plus `extra_forwards` (a recomputed pi_old)."""
    recompute = getattr(model_config, "recompute", None)
    per_epoch = 3 + (1 if recompute is not None and recompute.granularity == "full" else 0)
    return epochs * per_epoch + extra_forwards


def seed_flops_per_gpu_s(model: ClusterModel, critic_model_config: ModelConfig, epochs: int) -> float:
    """Training FLOPs per second per GPU that reproduce the seed's critic step (its geometric
    mean time) with this config's critic architecture, epochs and recomputation."""
    lengths = [model.seed_tokens_per_sequence] * model.seed_sequences
    flops = training_passes(critic_model_config, epochs) * forward_flops(
        critic_model_config.architecture, lengths, False
    )
    return flops / (model.seed_gpus * math.sqrt(model.seed_step_s_low * model.seed_step_s_high))


def spread(model: ClusterModel, seed: int, what: str, step: int) -> float:
    """A step's factor on its modelled training time: log-uniform over the seed's range
    [seed_step_s_low, seed_step_s_high] around its geometric mean (0.54x-1.84x with the defaults),
    drawn from (seed, what, step)."""
    mean = math.sqrt(model.seed_step_s_low * model.seed_step_s_high)
    u = (zlib.crc32(f"{seed}:{what}:{step}".encode()) & 0xFFFFFFFF) / 2**32
    low, high = math.log(model.seed_step_s_low / mean), math.log(model.seed_step_s_high / mean)
    return math.exp(low + u * (high - low))


def group_of(prompt_ids) -> int:
    """The group id a stand-in prompt encodes in its first three tokens (base 1000)."""
    return int(prompt_ids[0]) * 1_000_000 + int(prompt_ids[1]) * 1000 + int(prompt_ids[2])


class SimTokenizer:
    """The tokenizer stand-in: a prompt "row N" is `prompt_tokens` ids that start with N in base
    1000 (so the critic stand-in knows each /score request's group); decoding is O(1). Real
    tokenisation and rewards are the tokenizer's and the environment's cost, not measured here."""

    chat_template = None

    def __init__(self, prompt_tokens: int, vocab_size: int):
        self.prompt_tokens, self.vocab_size = prompt_tokens, vocab_size
        if prompt_tokens < 3 or vocab_size < 1000:
            raise ValueError(
                f"SimTokenizer: prompt_tokens ({prompt_tokens}) >= 3 and vocab_size ({vocab_size}) >= 1000"
            )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        index = int(text.removeprefix("row "))
        head = [index // 1_000_000, (index // 1000) % 1000, index % 1000]
        return head + [
            (index * 7919 + 31 * k) % (self.vocab_size - 1) + 1 for k in range(self.prompt_tokens - 3)
        ]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return f"{len(ids)}:{ids[-1] if len(ids) else ''}"


class SimEnvironment(Environment):
    """Single-turn rows "row N"; the reward is a hash of the seed, the row and the completion's
    decoded text (in [0, 1), passed above 0.5): deterministic, and members of a group differ."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def row(self, index: int) -> dict:
        return {"index": index}

    def prompt(self, row: dict) -> str:
        return f"row {row['index']}"

    def step(self, row: dict, completions: list[str]) -> Turn:
        reward = (zlib.crc32(f"{self.seed}:{row['index']}:{completions[-1]}".encode()) % 10_000) / 10_000
        return Turn(reward=reward, passed=reward > 0.5)

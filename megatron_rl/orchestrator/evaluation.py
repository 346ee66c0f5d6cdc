"""Held-out evaluation through the same inference pool (`orchestrator.eval`).

Each set runs `num_examples` rows of its environment (rows from its own seed: never the
training rows) with its own sampling (`temperature` 0 is greedy; `samples_per_example` k gives
pass@k: a row counts when any of its k samples passes, and mean@k: the fraction of all samples
that pass) and its own chat template keywords (`chat_template_kwargs`, e.g. thinking off), at
step 0 and every `interval` steps. A set marked `judged` is graded by the run's LLM judge
(orchestrator.judge: its verdict weighed with the environment's reward, its pass threshold; the
set's `judge_score_mean`, and its unreadable verdicts among the errors, `JudgeVerdictError`).
Results are metrics only, never trained on. An
error (a failed rollout, or the set itself failing) is counted and reported per set and does
not stop training.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np

from megatron_rl.config import EvalConfig
from megatron_rl.envs import Environment, make_environment
from megatron_rl.envs.judge import Judge, JudgedEnvironment
from megatron_rl.inference.rollout import SamplingParams
from megatron_rl.orchestrator.rollouts import run_member

EVAL_GROUP_OFFSET = 1 << 40  # session ids of evaluation rollouts never collide with training's


class Evaluator:
    """`judge` (envs/judge.py Judge): grades the sets marked `judged`; a ValueError names such a set
    when there is none (the config's rules refuse it first)."""

    def __init__(self, eval_configs: list[EvalConfig], client, encoder, default_max_tokens: int, seed: int,
                 judge: Judge | None = None):  # fmt: skip
        self.sets = []
        for config in eval_configs:
            env = make_environment(config.environment, config.dataset, config.seed,
                                   key=f"orchestrator.eval ({config.name}).environment", args=config.environment_args)
            if config.judged:
                if judge is None:
                    raise ValueError(f"orchestrator.eval ({config.name}).judged: no judge was given to grade the set "
                                    "(orchestrator.judge)")  # fmt: skip
                env = JudgedEnvironment(env, judge)
            sampling = SamplingParams(temperature=config.temperature, top_p=1.0,
                                      max_tokens=config.max_completion_tokens or default_max_tokens, seed=seed)  # fmt: skip
            set_encoder = encoder.with_template_kwargs(config.chat_template_kwargs)
            set_encoder.check_environment(env, f"orchestrator.eval ({config.name}).environment")
            self.sets.append((config, env, sampling, set_encoder))
        self.client = client

    async def aclose(self) -> None:
        """Releases what the sets' environments hold open (Environment.aclose)."""
        for _, env, *_ in self.sets:
            await env.aclose()

    def due(self, step: int) -> bool:
        return any(step == 0 or step % config.interval == 0 for config, *_ in self.sets)

    async def run(self, step: int, every_set: bool = False) -> dict:
        """The sets due at `step` (all of them with `every_set`: an eval-only run)."""
        results = {}
        for config, env, sampling, encoder in self.sets:
            if not (every_set or step == 0 or step % config.interval == 0):
                continue
            try:
                results.update(await self._run_set(config, env, sampling, encoder, step))
            except Exception as exc:  # reported, never fatal
                results[f"eval/{config.name}/error"] = f"{type(exc).__name__}: {exc}"
        return results

    async def _run_set(
        self, config: EvalConfig, env: Environment, sampling: SamplingParams, encoder, step: int
    ) -> dict:
        k = config.samples_per_example
        tasks = [
            run_member(
                env,
                env.row(i),
                self.client,
                encoder,
                sampling,
                EVAL_GROUP_OFFSET + step * 1_000_000 + i,
                branch,
                sampling.max_tokens,
            )  # fmt: skip
            for i in range(config.num_examples)
            for branch in range(k)
        ]
        members = await asyncio.gather(*tasks, return_exceptions=True)
        passed = np.zeros((config.num_examples, k), dtype=bool)
        rewards, verdicts, errors = [], [], Counter()  # failed rollouts by their error's kind (the exception's name)
        for index, member in enumerate(members):
            example, branch = divmod(index, k)
            if isinstance(member, BaseException):
                errors[type(member).__name__] += 1
                continue
            rewards.append(member.reward)
            if member.judge_score is not None:
                verdicts.append(member.judge_score)
            passed[example, branch] = bool(member.passed)
        name = f"eval/{config.name}"
        return {
            f"{name}/pass@{k}": float(passed.any(axis=1).mean()),
            f"{name}/mean@{k}": float(passed.mean()),
            f"{name}/reward_mean": float(np.mean(rewards)) if rewards else None,
            **({f"{name}/judge_score_mean": float(np.mean(verdicts)) if verdicts else None} if config.judged else {}),
            f"{name}/errors": sum(errors.values()),
            **({f"{name}/error_kinds": dict(errors)} if errors else {}),
        }

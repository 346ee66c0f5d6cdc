"""The distillation section: on-policy distillation from a teacher served by vLLM.

The student samples; the teacher scores every sampled token (vLLM's `prompt_logprobs` of the
exact token sequence); the per-token reverse-KL estimate k_t = log pi_student(a_t) - log
pi_teacher(a_t) on action tokens becomes a dense reward -coef * k_t beside the task reward
(algorithms/distillation.py, docs/algorithms/distillation.md), or `kl_penalty`: a term of the
policy's loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_rl.config.base import Strict, secret_from_env


class TeacherConfig(Strict):
    """The teacher: a model served by vLLM (a server, or a vllm-router in front of several) that
    the run reaches at `url`; started by the user (`megatron-rl run` does not start it)."""

    url: str = Field(description="Base URL of the teacher's vLLM server or router (http://host:port); it must serve served_model_name and take token-id prompts with prompt_logprobs.")
    served_model_name: str = Field(default="teacher", description="The model name the teacher's server answers /v1/models with.")
    model_dir: str = Field(description="The teacher's HF directory (relative to the config file): its tokenizer must be the student's, checked at start-up.")
    api_key_env: str | None = Field(default=None, description="The name of an environment variable holding the teacher server's API key; null: none.")
    max_concurrent: int = Field(default=64, gt=0, description="Teacher requests in flight at once (one per sample).")
    timeout_s: float = Field(default=600.0, gt=0, description="How long one teacher request may take, in seconds.")

    def api_key(self) -> str | None:
        return secret_from_env(self.api_key_env, "distillation.teacher.api_key_env")


class DistillationConfig(Strict):
    """On-policy distillation: the teacher's log-probabilities of the student's tokens."""

    teacher: TeacherConfig = Field(description="The teacher model and where it is served.")
    coef: float = Field(default=1.0, gt=0, description="Weight of the reverse-KL estimate: each action token's dense reward is -coef * (log pi_student - log pi_teacher).")
    mode: Literal["reward", "kl_penalty"] = Field(default="reward", description="How the signal enters training: 'reward': a dense per-token reward beside the task reward (GAE takes it per token; outcome estimators its sum over the sample); 'kl_penalty': coef x the per-token KL estimate algorithm.kl_estimator (k2 or k3) between the student and the teacher, a term of the policy's loss (the teacher's log-probabilities travel in the policy's grid).")

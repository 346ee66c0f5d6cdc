"""The distillation section: on-policy distillation from a teacher served by vLLM.

The student samples; the teacher scores every sampled token (vLLM's `prompt_logprobs` of the
exact token sequence); the per-token reverse-KL estimate k_t = log pi_student(a_t) - log
pi_teacher(a_t) on action tokens becomes a dense reward -coef * k_t beside the task reward
(algorithms/distillation.py, docs/algorithms/distillation.md), or `advantage`: -coef * k_t added
to each action token's advantage after the estimator, or `kl_penalty`: a term of the policy's
loss."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import Strict, secret_from_env
from megatron_rl.config.inference import ServeConfig


class TeacherServeConfig(ServeConfig):
    """The teacher's own vLLM servers and router, started by the run from `teacher.model_dir`."""

    base_port: int = Field(default=8300, gt=0, lt=65536, description="Port of the teacher's server 0; server i listens on base_port + i.")
    router_port: int = Field(default=8350, gt=0, lt=65536, description="Port of the vllm-router in front of the teacher's servers (the orchestrator's requests go there).")


def serve_unless_url(data: Any) -> Any:
    """A service section without `url` is served by the run: `serve` defaults to its own block."""
    if isinstance(data, dict) and data.get("url") is None and data.get("serve") is None:
        return {**data, "serve": {}}
    return data


class TeacherConfig(Strict):
    """The teacher: a model served by vLLM. Without `url` the run serves it itself (`serve`: its
    own vLLM servers and vllm-router on GPUs of their own, from `model_dir`); with `url` it is a
    server (or router) the user started."""

    url: str | None = Field(default=None, description="Base URL of a teacher the user serves, a vLLM server or router (http://host:port); it must serve served_model_name and take token-id prompts with prompt_logprobs. null: the run serves the teacher from model_dir (serve).")
    serve: TeacherServeConfig | None = Field(default=None, description="The teacher's vLLM servers and router that the run starts (its GPUs: num_servers x tp, beside every other role's); the default block when url is null; not with url.")
    served_model_name: str = Field(default="teacher", description="The model name the teacher's server answers /v1/models with.")
    model_dir: str = Field(description="The teacher's HF directory (relative to the config file): what a served teacher starts from; its tokenizer must be the student's, checked at start-up.")
    api_key_env: str | None = Field(default=None, description="The name of an environment variable holding the teacher server's API key; null: none.")
    max_concurrent: int = Field(default=64, gt=0, description="Teacher requests in flight at once (one per sample).")
    timeout_s: float = Field(default=600.0, gt=0, description="How long one teacher request may take, in seconds.")

    def api_key(self) -> str | None:
        return secret_from_env(self.api_key_env, "distillation.teacher.api_key_env")

    @model_validator(mode="before")
    @classmethod
    def _served_without_url(cls, data: Any) -> Any:
        """Without url the run serves the model: serve defaults to its block."""
        return serve_unless_url(data)

    @model_validator(mode="after")
    def _url_or_serve(self) -> TeacherConfig:
        """A teacher is the user's (url) or the run's (serve), not both."""
        if self.url is not None and self.serve is not None:
            raise ValueError(
                f"distillation.teacher: url ({self.url}: a teacher you serve) and serve (the run serves the "
                "teacher) exclude each other; remove one"
            )
        return self


class DistillationConfig(Strict):
    """On-policy distillation: the teacher's log-probabilities of the student's tokens."""

    teacher: TeacherConfig = Field(description="The teacher model and where it is served.")
    coef: float = Field(default=1.0, gt=0, description="Weight of the reverse-KL estimate: each action token's dense reward (mode reward) or advantage term (mode advantage) is -coef * (log pi_student - log pi_teacher); mode kl_penalty: the loss term's weight.")
    mode: Literal["reward", "advantage", "kl_penalty"] = Field(default="reward", description="How the signal enters training: 'reward': a dense per-token reward beside the task reward (GAE takes it per token; outcome estimators its sum over the sample); 'advantage': the estimator sees the task reward alone, then each action token's advantage gets -coef * k_t added, with k_t of the sampler's log-probability (Thinking Machines' / Tinker's recipe: the token's own reverse KL, not summed over the sample, not normalised over the group or whitened, not in the critic's returns); 'kl_penalty': coef x the per-token KL estimate algorithm.kl_estimator (k2 or k3) between the student and the teacher, a term of the policy's loss (the teacher's log-probabilities travel in the policy's grid).")

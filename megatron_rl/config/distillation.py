"""The distillation section: on-policy distillation from a teacher served by vLLM, or by a
forward-only Megatron service of the run's own (`teacher.megatron`, megatron_rl/teacher/).

The student samples; the teacher scores every sampled token (vLLM's `prompt_logprobs` of the
exact token sequence); the per-token reverse-KL estimate k_t = log pi_student(a_t) - log
pi_teacher(a_t) on action tokens becomes a dense reward -coef * k_t beside the task reward
(algorithms/distillation.py, docs/algorithms/distillation.md), or `advantage`: -coef * k_t added
to each action token's advantage after the estimator, or `kl_penalty`: a term of the policy's
loss."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron_rl.config.base import Strict, secret_from_env
from megatron_rl.config.inference import ServeConfig
from megatron_rl.config.model import ModelConfig


class TeacherServeConfig(ServeConfig):
    """The teacher's own vLLM servers and router, started by the run from `teacher.model_dir`."""

    base_port: int = Field(default=8300, gt=0, lt=65536, description="Port of the teacher's server 0; server i listens on base_port + i.")
    router_port: int = Field(default=8350, gt=0, lt=65536, description="Port of the vllm-router in front of the teacher's servers (the orchestrator's requests go there).")


class TeacherMegatronConfig(Strict):
    """The teacher as a forward-only Megatron service of the run (megatron_rl/teacher/): the
    teacher's HF weights (`teacher.model_dir`) in a Megatron GPT model on a layout of its own, no
    optimizer, behind an HTTP service on its rank 0 that returns each token's log-probability
    (docs/teacher-api.md). For a teacher vLLM cannot serve; its sequences are the student's
    samples, up to `model.seq_len` tokens."""

    gpus: int | None = Field(default=None, ge=1, description="The teacher's GPUs (processes on the cpu device), beside every other role's; null: tp x cp x pp (one replica). More GPUs are data-parallel replicas (gpus / (tp x cp x pp)).")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree of the teacher.")
    cp: int = Field(default=1, ge=1, description="Context-parallel degree of the teacher (a sequence split across ranks).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel degree of the teacher (stages).")
    ep: int = Field(default=1, ge=1, description="Expert-parallel degree of the teacher (MoE models).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="bfloat16", description="The teacher's parameter and compute dtype (its log-probabilities are computed in float32 from its logits).")
    transformer_engine: Literal["required", "auto", "off"] = Field(default="required", description="The TransformerEngine layer spec on deployment.device cuda, as model.transformer_engine.")
    host: str = Field(default="127.0.0.1", description="Address the teacher's service listens on (its rank 0's).")
    port: int = Field(default=8400, gt=0, lt=65536, description="TCP port of the teacher's service.")
    max_batch_sequences: int = Field(default=512, gt=0, description="Most sequences the teacher scores in one collective pass (waiting requests are merged up to this); the orchestrator's requests are split to this size.")
    isolate_requests: bool = Field(default=True, description="Pack each merged request's sequences into bins of their own, so that a sequence's log-probabilities are bit for bit those of its request scored alone (as value.service.isolate_requests).")
    request_timeout_s: float = Field(default=600.0, gt=0, description="Timeout of one scoring request inside the service, in seconds.")

    @field_validator("transformer_engine", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        """YAML reads a bare `off` as false."""
        return "off" if value is False else value

    def world_size(self) -> int:
        return self.gpus if self.gpus is not None else self.tp * self.cp * self.pp

    def as_model_config(self, model_dir: str, seq_len: int) -> ModelConfig:
        """The teacher as the layout code reads a model: its HF directory, the student's seq_len,
        its own degrees and dtype."""
        return ModelConfig(hf_config=model_dir, checkpoint=model_dir, seq_len=seq_len, tp=self.tp, cp=self.cp,
                           pp=self.pp, ep=self.ep, dtype=self.dtype, transformer_engine=self.transformer_engine)  # fmt: skip


def serve_unless_url(data: Any) -> Any:
    """A service section without `url` is served by the run: `serve` defaults to its own block."""
    if isinstance(data, dict) and data.get("url") is None and data.get("serve") is None and data.get("megatron") is None:
        return {**data, "serve": {}}
    return data


class TeacherConfig(Strict):
    """The teacher: a model served by vLLM, or a forward-only Megatron service (`megatron`).
    Without `url` or `megatron` the run serves it itself with vLLM (`serve`: its own vLLM servers
    and vllm-router on GPUs of their own, from `model_dir`); with `url` it is a server (or
    router) the user started; with `megatron` the run starts the teacher's Megatron service
    (megatron_rl/teacher/) on GPUs of its own."""

    url: str | None = Field(default=None, description="Base URL of a teacher the user serves, a vLLM server or router (http://host:port); it must serve served_model_name and take token-id prompts with prompt_logprobs. null: the run serves the teacher from model_dir (serve).")
    serve: TeacherServeConfig | None = Field(default=None, description="The teacher's vLLM servers and router that the run starts (its GPUs: num_servers x tp, beside every other role's); the default block when url is null; not with url.")
    megatron: TeacherMegatronConfig | None = Field(default=None, description="The teacher as a forward-only Megatron service the run starts from model_dir on a layout of its own (for a teacher vLLM cannot serve); not with url or serve.")
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
        """A teacher is the user's (url), the run's vLLM (serve) or the run's Megatron service
        (megatron): one of them."""
        if self.megatron is not None and (self.url is not None or self.serve is not None):
            other = "url" if self.url is not None else "serve"
            raise ValueError(
                f"distillation.teacher: megatron (the run's Megatron teacher service) and {other} exclude each "
                "other; remove one"
            )
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
    mode: Literal["reward", "advantage", "kl_penalty", "top_k_kl"] = Field(default="reward", description="How the signal enters training: 'reward': a dense per-token reward beside the task reward (GAE takes it per token; outcome estimators its sum over the sample); 'advantage': the estimator sees the task reward alone, then each action token's advantage gets -coef * k_t added, with k_t of the sampler's log-probability (Thinking Machines' / Tinker's recipe: the token's own reverse KL, not summed over the sample, not normalised over the group or whitened, not in the critic's returns); 'kl_penalty': coef x the per-token KL estimate algorithm.kl_estimator (k2 or k3) between the student and the teacher, a term of the policy's loss (the teacher's log-probabilities travel in the policy's grid); 'top_k_kl': coef x the forward KL of the teacher's top_k most likely tokens from the student's distribution at every action token's position, sum_j p_teacher(j) (log p_teacher(j) - log p_student(j)) over the teacher's top_k j, a term of the policy's loss (NeMo-RL's and verl's top-k logit distillation: a full-distribution signal at every position the student visits, not one sampled token; the teacher's top_k ids and log-probabilities travel in the policy's grid, 8 x top_k bytes an action token).")
    top_k: int = Field(default=64, ge=1, description="Mode top_k_kl: how many of the teacher's most likely tokens each action position carries (the teacher's log-probabilities of them at temperature 1). A vLLM teacher must allow it (vLLM's --max-logprobs; the run's own vLLM teacher is started with it).")

    baseline: Literal["none", "batch_mean", "group_mean"] = Field(default="none", description="Mode advantage only: a baseline b subtracted from k_t in the term added to each action token's advantage, -coef * (k_t - b). 'none': b = 0 (Tinker's recipe); 'batch_mean': b the mean of k_t over the step's action tokens (all its groups); 'group_mean': b the mean over the action tokens of the sample's group. Since E over the student's tokens of grad log pi_student(a_t) is 0 at every prefix, a b that does not depend on the token leaves the term's gradient unbiased (up to the sample's own share of the mean) and removes the push-down common to every sampled token. Refused with mode reward (summed over the sample or GAE's per-token rewards, a per-token constant becomes a length bonus) and kl_penalty (a constant has no gradient in the loss's KL estimator).")

    @model_validator(mode="after")
    def _baseline_needs_advantage_mode(self) -> DistillationConfig:
        """A baseline for k_t is only a baseline where k_t weighs grad log pi_student(a_t) alone
        (mode advantage)."""
        if self.baseline != "none" and self.mode != "advantage":
            why = {"reward": "the dense reward is summed over the sample (outcome estimators) or accumulated by GAE "
                             "into the returns, so a per-token constant becomes coef x b x the sample's action tokens: a "
                             "length bonus, not a baseline",
                   "kl_penalty": "the KL estimator is a term of the loss, where a constant has no gradient",
                   "top_k_kl": "the top-k KL is a term of the loss over the teacher's whole top k at each position, "
                               "not a sampled token's score"}[self.mode]
            raise ValueError(
                f"distillation.baseline {self.baseline!r} is for distillation.mode 'advantage', not {self.mode!r}: "
                f"{why}; use mode advantage or baseline none"
            )
        return self

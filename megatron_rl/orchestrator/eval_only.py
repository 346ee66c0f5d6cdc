"""`megatron-rl eval CONFIG`: the config's evaluation sets (`orchestrator.eval`) on one model,
without training, with the same pool, chat template, environments and metrics as a training run.

The model is the config's own (`inference.model_dir`, else `model.hf_config`), another HF
directory (`--model DIR`), or a step of the run's policy checkpoints (`--checkpoint latest|N|DIR`),
converted to an HF directory first (under `logging.dir/eval/`, the config's HF files and
tokenizer beside it). The servers are started for it (as `megatron-rl orchestrate
--start-inference` starts them) or, with `--attach`, the running ones are used as they are.
Every set runs once; the metrics (`eval/NAME/pass@k`, `mean@k`, `reward_mean`, `errors`) are
printed and appended as one JSON line to `logging.dir/eval_metrics.jsonl` with the model they
are of.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from megatron_rl.config import Layout, LoggingConfig, OrchestratorConfig, ResolvedConfig
from megatron_rl.envs.judge import Judge
from megatron_rl.inference.pool import served_model_dir
from megatron_rl.inference.rollout import RolloutClient
from megatron_rl.orchestrator.evaluation import Evaluator

log = logging.getLogger(__name__)
EVAL_METRICS = "eval_metrics.jsonl"


class EvalError(ValueError):
    """What `megatron-rl eval` cannot do, naming the input."""


def policy_checkpoint(layout: Layout, which: str) -> Path:
    """The step directory `which` names: `latest`, a step number of the run's policy checkpoints
    (`layout.paths.policy_checkpoints`: `checkpoint.dir/policy`), or a step directory's path."""
    root = Path(layout.paths.policy_checkpoints)
    if which == "latest":
        from megatron_rl.trainer.atomic_dir import latest

        found = latest(root, "meta.json")
        if found is None:
            raise EvalError(f"--checkpoint latest: no complete policy checkpoint in {root}")
        return found
    if which.isdigit():
        step_dir = root / f"step_{int(which):08d}"
        if not (step_dir / "meta.json").is_file():
            steps = sorted(p.name for p in root.glob("step_*") if (p / "meta.json").is_file())
            raise EvalError(f"--checkpoint {which}: no complete checkpoint {step_dir} (there are: {steps or 'none'})")
        return step_dir
    if not (Path(which) / "meta.json").is_file():
        raise EvalError(f"--checkpoint {which}: not a checkpoint step directory (no meta.json)")
    return Path(which)


def export_policy(resolved: ResolvedConfig, step_dir: Path, out: Path) -> Path:
    """The HF directory of a policy checkpoint step (converted once; reused when already there)."""
    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    from megatron_rl.transforms.lora_export import export_hf

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    partial = out.with_name(out.name + ".partial")
    for line in export_hf(step_dir, partial, Path(served_model_dir(resolved)), value_model=False):
        log.info("eval: %s", line)
    partial.rename(out)
    return out


def eval_model_dir(resolved: ResolvedConfig, model: str | None, checkpoint: str | None) -> tuple[Path, str]:
    """(the HF directory to evaluate, how the metrics name it)."""
    if model and checkpoint:
        raise EvalError("give --model or --checkpoint, not both")
    if checkpoint:
        step_dir = policy_checkpoint(resolved.layout, checkpoint)
        out = Path(resolved.logging.dir) / "eval" / step_dir.name
        return export_policy(resolved, step_dir, out), f"checkpoint {step_dir}"
    directory = Path(model) if model else Path(served_model_dir(resolved))
    if not (directory / "config.json").is_file():
        raise EvalError(f"{'--model' if model else 'inference.model_dir'}: {directory} is not an HF directory (no config.json)")
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise EvalError(f"{directory}: no tokenizer files (tokenizer.json / tokenizer_config.json) to render prompts with")
    return directory, str(directory)


async def evaluate(resolved: ResolvedConfig, router_url: str, model_name: str, worker_urls, tokenizer) -> dict:
    """Every evaluation set once through the router; the metrics."""
    from megatron_rl.orchestrator.run import prompt_encoder

    o = resolved.orchestrator
    client = RolloutClient(router_url, model_name, worker_urls, timeout_s=resolved.inference.request_timeout_s,
                           api_key=resolved.inference.api_key())  # fmt: skip
    evaluator = judge = None
    try:
        if any(s.judged for s in o.eval):
            judge = Judge(o.judge, url=judge_url(o))
        evaluator = Evaluator(o.eval, client, prompt_encoder(o, tokenizer), o.max_completion_tokens, o.seed, judge=judge)
        return await evaluator.run(0, every_set=True)
    finally:
        await client.close()
        if evaluator is not None:
            await evaluator.aclose()
        if judge is not None:
            await judge.close()


def judge_url(orchestrator: OrchestratorConfig) -> str:
    """The URL of the judge of judged evaluation sets: `megatron-rl eval` starts the policy's
    servers only, so the judge is one the user serves (orchestrator.judge.url); an EvalError
    otherwise."""
    judged = [s.name for s in orchestrator.eval if s.judged]
    if orchestrator.judge.url is None:
        raise EvalError(
            f"orchestrator.eval {judged}: judged sets need a judge at orchestrator.judge.url under megatron-rl eval, "
            "which serves the evaluated model only (a judge without url is served by megatron-rl run)"
        )
    return orchestrator.judge.url


def write_metrics(logging_config: LoggingConfig, model: str, results: dict, seconds: float) -> Path:
    """Appends one JSON line (time, `model`, eval_s, `results`) to `logging.dir/eval_metrics.jsonl`;
    returns its path."""
    path = Path(logging_config.dir) / EVAL_METRICS
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"time": time.time(), "model": model, "eval_s": round(seconds, 3), **results}
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return path


def check_sets(orchestrator: OrchestratorConfig) -> None:
    """EvalError when `orchestrator.eval` names no evaluation set, or judged sets have no judge
    megatron-rl eval can reach (`judge_url`)."""
    if not orchestrator.eval:
        raise EvalError("orchestrator.eval: the config names no evaluation set to run")
    if any(s.judged for s in orchestrator.eval):
        judge_url(orchestrator)

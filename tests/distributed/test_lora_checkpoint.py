"""LoRA policy checkpoints on gloo ranks (PolicyTrainer from a resolved config, the tiny qwen3
as its HF base): what a checkpoint holds, resuming it, refusing another base, exporting it.

- the checkpoint's `dist/` holds the adapters (and their optimizer state) only, meta.json the
  base's path and fingerprint; it is a fraction of the size of the same step written with every
  tensor (the format before);
- trained 4 steps with a save after step 1, then resumed in new processes on a copy of the base
  (same files, another path): the losses, metrics and log-probs of steps 2 and 3 equal the
  uninterrupted run's exactly;
- a base with other weights (same file names and sizes) is refused on resume, naming both paths;
- `megatron-rl export-lora` writes a PEFT adapter directory that transformers + PEFT load onto
  the base with the trainer's logits, and with `--merged` HF weights that transformers loads
  alone with the same logits (atol 1e-4), from an HF base and from a converted one; `eval
  --checkpoint`'s conversion (export_hf) gives the merged export's tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from megatron_rl.config import load_config, load_resolved
from megatron_rl.parallel import free_port
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks

SEQ_LEN, RANK, ALPHA = 64, 4, 8.0
STEPS, SAVE_AT = 4, 1
KEYS = ("loss", "kl_ref", "grad_norm", "entropy", "ratio_mean", "clip_fraction", "approx_kl")


def write_config(directory: Path, base: Path, checkpoints: Path, hf_config: Path) -> tuple[Path, Path]:
    """(YAML, resolved JSON) of a CPU GRPO run with a rank-4 LoRA policy on one rank, KL on."""
    directory.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(4)]
    config = {
        "model": {"hf_config": str(hf_config), "checkpoint": str(base), "seq_len": SEQ_LEN, "dtype": "float32"},
        "lora": {"rank": RANK, "alpha": ALPHA},
        "optimizer": {"lr": 1e-2, "grad_clip": 1.0},
        "algorithm": {"type": "grpo", "kl_coef": 0.1, "kl_estimator": "k2"},
        "orchestrator": {"num_steps": STEPS, "batch_size": 4, "group_size": 2, "max_prompt_tokens": 16,
                         "max_completion_tokens": 32},  # fmt: skip
        "inference": {"backend": "vllm-cpu", "weight_update": "safetensors", "publish_dir": str(directory / "published"),
                      "base_port": ports[2], "weight_broadcast_port": ports[3]},  # fmt: skip
        "deployment": {"device": "cpu", "nodes": 1, "gpus_per_node": 2, "inference_gpus": 1, "policy_gpus": 1},
        "transport": {"policy_port": ports[0], "critic_port": ports[1], "receive_timeout_s": 60},
        "checkpoint": {"dir": str(checkpoints), "save_interval": 0, "resume": True},
        "logging": {"dir": str(directory / "logs")},
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    resolved = directory / "resolved.json"
    resolved.write_text(json.dumps(json.loads(load_config(path).to_json())))
    return path, resolved


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    """The uninterrupted run: its config, checkpoint step and what `train_policy` recorded."""
    root = tmp_path_factory.mktemp("lora_ckpt")
    base = tiny_models["qwen3"]
    yaml_path, resolved = write_config(root / "run", base, root / "checkpoints", base)
    (out,) = run_ranks(train_policy, 1, str(resolved), True)
    return {"root": root, "yaml": yaml_path, "resolved": resolved, "base": base, "out": out,
            "step_dir": root / "checkpoints" / "policy" / f"step_{SAVE_AT:08d}"}  # fmt: skip


def test_the_checkpoint_holds_the_adapters_and_names_the_base(run):
    out, step_dir = run["out"], run["step_dir"]
    model_keys = [k for k in out["saved_keys"] if not k.startswith("optimizer.")]
    assert sorted(model_keys) == sorted(out["adapter_keys"]) and len(model_keys) == 4 * 2  # 4 linears, A and B (layers stacked)
    meta = json.loads((step_dir / "meta.json").read_text())
    lora = meta["lora"]
    assert (lora["key"], lora["rank"], lora["alpha"]) == ("lora", RANK, ALPHA)
    assert lora["target_modules"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert lora["base"]["checkpoint"] == str(run["base"].absolute()) and lora["base"]["where"] == "model.checkpoint"
    from megatron_rl.transforms.lora_base import fingerprint

    assert lora["base"]["fingerprint"] == fingerprint(run["base"])
    # the same step with every tensor (the format before): the base makes most of it
    lora_bytes, full_bytes = out["sizes"]
    print(f"\ncheckpoint dist/ of the tiny LoRA policy: {lora_bytes:,} bytes adapters-only, {full_bytes:,} bytes with the base")
    assert lora_bytes * 3 < full_bytes


def test_resume_in_new_processes_equals_the_uninterrupted_run(run, tmp_path):
    moved = tmp_path / "moved_base"
    shutil.copytree(run["base"], moved)  # the same base elsewhere: its fingerprint names it
    _, resolved = write_config(tmp_path / "resumed", moved, run["root"] / "checkpoints", run["base"])
    (resumed,) = run_ranks(train_policy, 1, str(resolved), False)
    straight = run["out"]
    assert resumed["resumed_step"] == SAVE_AT and resumed["steps"] == list(range(SAVE_AT + 1, STEPS))
    assert resumed["loaded"] == f"checkpoint step {SAVE_AT} in {run['root'] / 'checkpoints' / 'policy'}"
    for got, expected in zip(resumed["records"], straight["records"][SAVE_AT + 1 :], strict=True):
        assert {k: got[k] for k in KEYS} == {k: expected[k] for k in KEYS}  # exactly
    for got, expected in zip(resumed["logprobs"], straight["logprobs"][SAVE_AT + 1 :], strict=True):
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
    assert straight["records"][SAVE_AT + 1]["loss"] != straight["records"][SAVE_AT]["loss"]


def test_resume_on_another_base_is_refused_naming_both(run, tmp_path):
    other = tmp_path / "other_base"
    shutil.copytree(run["base"], other)
    tensors = load_file(other / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3  # other weights, same names, shapes and file size
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert (other / "model.safetensors").stat().st_size == (run["base"] / "model.safetensors").stat().st_size
    _, resolved = write_config(tmp_path / "other", other, run["root"] / "checkpoints", run["base"])
    (error,) = run_ranks(resume_error, 1, str(resolved))
    assert "its LoRA adapters were trained on the base " + str(run["base"].absolute()) in error
    assert f"but model.checkpoint is now {other.absolute()}" in error
    assert str(run["step_dir"]) in error and "refused" in error


def test_export_lora_gives_the_trainers_logits_as_peft_and_merged(run, tmp_path):
    lines = run_ranks(export_both, 1, str(run["step_dir"]), str(run["yaml"]), str(tmp_path))[0]
    check_exports(lines, tmp_path, run["base"], run["out"])


def test_a_converted_base_is_named_by_the_checkpoint_and_exported(tiny_models, tmp_path):
    """A converted megatron checkpoint as the base: the LoRA checkpoint names it, and the merged
    export reads it (PEFT's base_model_name_or_path is the HF directory it was converted from)."""
    hf = tiny_models["qwen3"]
    converted = tmp_path / "converted"
    run_ranks(convert_base, 1, str(hf), str(converted))
    yaml_path, resolved = write_config(tmp_path / "run", converted, tmp_path / "checkpoints", hf)
    (out,) = run_ranks(train_policy, 1, str(resolved), True)
    step_dir = tmp_path / "checkpoints" / "policy" / f"step_{SAVE_AT:08d}"
    assert json.loads((step_dir / "meta.json").read_text())["lora"]["base"]["checkpoint"] == str(converted.absolute())
    lines = run_ranks(export_both, 1, str(step_dir), str(yaml_path), str(tmp_path / "export"))[0]
    check_exports(lines, tmp_path / "export", hf, out)


def check_exports(lines: dict, directory: Path, hf_base: Path, out: dict) -> None:
    """The PEFT and merged exports in `directory` give the trainer's logits `out["logits_at_save"]`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert lines["peft_rc"] == 0 and lines["merged_rc"] == 0, lines
    adapter, merged = directory / "adapter", directory / "merged"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_base.absolute())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in merged.iterdir()}
    assert not any("lora" in k for k in load_file(merged / "model.safetensors"))
    input_ids, expected = out["input_ids"], out["logits_at_save"]
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32).eval()
        plain = base(input_ids).logits
        with_adapter = PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids).logits
    assert (expected - plain).abs().max() > 1e-3  # the adapters trained
    torch.testing.assert_close(with_adapter, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(merged_logits, expected, atol=1e-4, rtol=0)
    # an existing output is not overwritten; a full-model checkpoint is not LoRA
    assert lines["again_rc"] == 2 and "not empty; refusing to overwrite" in lines["again_err"]
    assert lines["full_rc"] == 2 and "its meta.json has no lora section" in lines["full_err"]
    # `eval --checkpoint`'s conversion of the step (export_hf) merges it the same way
    merged_tensors, eval_tensors = load_file(merged / "model.safetensors"), load_file(directory / "eval" / "model.safetensors")
    assert sorted(eval_tensors) == sorted(merged_tensors)
    assert all(torch.equal(eval_tensors[k], t) for k, t in merged_tensors.items())
    assert "a LoRA training checkpoint (adapters only, no base weights)" in lines["plain_conversion"]
    assert "export_hf" in lines["plain_conversion"] and not (directory / "plain").exists()


# Rank functions: module-level, so that the spawned ranks can import them.


def _step_batches(vocab: int, step: int):
    from megatron_rl.data.packing import pack_into_grid

    return pack_into_grid(training_samples(4, vocab, seed=100 + step), SEQ_LEN, 1)[0]


def train_policy(rank, world_size, resolved_path, uninterrupted):
    """The uninterrupted run (`uninterrupted`: steps 0..STEPS-1, a save after SAVE_AT, and the
    same step saved with every tensor for its size), or a resumed one (from the newest
    checkpoint to the end): per step the update's metrics and log-probs on fixed probe rows."""
    from megatron_rl.conversion.spec_keys import checkpoint_keys
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy.loss import forward_logprobs, policy_batch
    from megatron_rl.policy.trainer import PolicyTrainer
    from megatron_rl.policy.update import policy_update
    from megatron_rl.trainer.checkpoint import save_checkpoint

    resolved = load_resolved(resolved_path)
    trainer = PolicyTrainer(resolved)
    vocab = trainer.arch.vocab_size
    probe = [policy_batch(mb, 0, 1) for mb in pack_into_grid(training_samples(3, vocab, seed=7), SEQ_LEN, 1)[0]]
    meta = None if uninterrupted else trainer.resume()
    start = 0 if meta is None else meta["step"] + 1
    out = {"resumed_step": None if meta is None else meta["step"], "loaded": trainer.loaded, "steps": [],
           "records": [], "logprobs": []}  # fmt: skip
    for step in range(start, STEPS):
        record = policy_update(trainer.trainable, _step_batches(vocab, step), trainer.settings, reference=trainer.reference)
        out["steps"].append(step)
        out["records"].append({k: record[k] for k in KEYS})
        out["logprobs"].append(forward_logprobs(trainer.model, probe))
        if uninterrupted and step == SAVE_AT:
            path = trainer.save(step)
            out["saved_keys"] = sorted(checkpoint_keys(path / "dist"))
            out["adapter_keys"] = sorted({e.key for k, e in trainer.model.sharded_state_dict().items() if ".lora_" in k})
            full = save_checkpoint(Path(resolved.checkpoint.dir) / "with_base", step, trainer.trainable)
            out["sizes"] = [sum(f.stat().st_size for f in (p / "dist").rglob("*") if f.is_file()) for p in (path, full)]
            input_ids = torch.randint(1, vocab, (1, 20), generator=torch.Generator().manual_seed(2))
            positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            trainer.model.eval()
            with torch.no_grad():
                out["logits_at_save"] = trainer.model(input_ids, positions, attention_mask=None).clone()
            trainer.model.train()
            out["input_ids"] = input_ids
    trainer.close()
    return out


def resume_error(rank, world_size, resolved_path):
    from megatron_rl.policy.trainer import PolicyTrainer

    trainer = PolicyTrainer(load_resolved(resolved_path))
    try:
        trainer.resume()
    except ValueError as error:
        return str(error)
    finally:
        trainer.close()
    return "resumed"


def export_both(rank, world_size, step_dir, yaml_path, out):
    """`megatron-rl export-lora` as a PEFT adapter, then --merged, then once more into the PEFT
    directory: (exit codes, the last one's stderr)."""
    import contextlib
    import io

    from megatron_rl.launch import cli

    result = {}
    for name, extra in (("peft", []), ("merged", ["--merged"]), ("again", [])):
        target = f"{out}/{'merged' if name == 'merged' else 'adapter'}"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            result[f"{name}_rc"] = cli.main(["export-lora", step_dir, "--config", yaml_path, "--out", target, *extra])
        result[f"{name}_err"] = err.getvalue()
    err = io.StringIO()  # the same step written with every tensor (the format of full fine-tuning)
    full_step = Path(step_dir).parent.parent / "with_base" / Path(step_dir).name
    with contextlib.redirect_stderr(err):
        result["full_rc"] = cli.main(["export-lora", str(full_step), "--config", yaml_path, "--out", f"{out}/full"])
    result["full_err"] = err.getvalue()
    # what `megatron-rl eval --checkpoint` converts a step with: merged into the base meta.json names
    from megatron_rl.conversion.convert import checkpoint_to_hf
    from megatron_rl.conversion.hf_mapping import ConversionError
    from megatron_rl.transforms.lora_export import export_hf

    base = yaml.safe_load(Path(yaml_path).read_text())["model"]["hf_config"]
    export_hf(Path(step_dir), Path(out) / "eval", Path(base), value_model=False)
    try:  # the plain conversion has no base to merge into: it refuses the step, naming the tool
        checkpoint_to_hf(Path(step_dir), Path(out) / "plain", Path(base), value_model=False)
    except ConversionError as error:
        result["plain_conversion"] = str(error)
    return result


def convert_base(rank, world_size, hf_dir, out):
    from megatron_rl.conversion.convert import hf_to_checkpoint

    return hf_to_checkpoint(Path(hf_dir), Path(out))

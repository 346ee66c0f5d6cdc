"""tools/convert_*: HF -> Megatron -> HF is bit-exact; converted checkpoints reshard on load;
bad input exits non-zero naming the file or tensor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config import Architecture
from megatron_rl.testing.ranks import gather_vocab, hf_logits
from megatron_rl.testing.spawn import run_ranks

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run_tool(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *map(str, args)], capture_output=True, text=True, timeout=300
    )


def convert_both_ways(hf_dir: Path, work: Path, *extra) -> tuple[dict, dict, subprocess.CompletedProcess]:
    to_mg = run_tool("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", work / "mg", *extra)
    assert to_mg.returncode == 0, to_mg.stderr
    back = run_tool(
        "convert_megatron_to_hf.py", "--megatron", work / "mg", "--out", work / "hf", "--hf-config", hf_dir
    )
    assert back.returncode == 0, back.stderr
    return load_file(hf_dir / "model.safetensors"), load_file(work / "hf" / "model.safetensors"), to_mg


def assert_bit_exact(original: dict, restored: dict):
    assert set(original) == set(restored)
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_round_trip_is_bit_exact(family, tiny_models, tmp_path):
    original, restored, to_mg = convert_both_ways(tiny_models[family], tmp_path)
    assert_bit_exact(original, restored)
    assert "GPT model" in to_mg.stdout and "wrote" in to_mg.stdout
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "config.json").is_file()


def test_tied_embeddings_round_trip(tmp_path):
    from megatron_rl.models.tiny import make_tiny_model

    hf_dir = make_tiny_model("qwen3", tmp_path / "tied", seed=5, tied=True)
    original, restored, _ = convert_both_ways(hf_dir, tmp_path / "work")
    assert "lm_head.weight" not in original
    assert_bit_exact(original, restored)


def test_value_model_round_trip(tiny_models, tmp_path):
    hf_dir = tiny_models["qwen3"]
    backbone, restored, to_mg = convert_both_ways(
        hf_dir, tmp_path / "first", "--value-model", "--head-init-std", "0.02"
    )
    assert "value head initialised, std 0.02" in to_mg.stdout
    assert restored["value_head.weight"].shape == (1, 64) and restored["value_head.weight"].abs().sum() > 0
    assert "lm_head.weight" not in restored
    assert_bit_exact(
        {k: v for k, v in backbone.items() if k != "lm_head.weight"},
        {k: v for k, v in restored.items() if not k.startswith("value_head.")},
    )
    # HF with a value head -> value model -> HF keeps the head as its own tensor, bit-exact.
    with_head = tmp_path / "with_head"
    with_head.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (with_head / name).write_bytes((hf_dir / name).read_bytes())
    save_file(restored, str(with_head / "model.safetensors"))
    again_original, again, to_mg = convert_both_ways(with_head, tmp_path / "second", "--value-model")
    assert "value head from the HF checkpoint" in to_mg.stdout
    assert_bit_exact(again_original, again)


def load_logits(rank, world_size, checkpoint, tp, input_ids):
    """Loads a converted checkpoint at TP=tp (it was saved at TP=1): full-vocabulary logits."""
    from megatron.core import dist_checkpointing

    from megatron_rl import parallel
    from megatron_rl.models.builder import build_gpt_model

    meta = json.loads((Path(checkpoint) / "megatron_rl.json").read_text())
    arch = Architecture(**meta["architecture"])
    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp)
    model.load_state_dict(
        dist_checkpointing.load(model.sharded_state_dict(), str(Path(checkpoint) / "model"))
    )
    model.eval()
    with torch.no_grad():
        out = model(input_ids, torch.arange(input_ids.shape[1]).expand_as(input_ids), attention_mask=None)
    return gather_vocab(out)


def test_converted_checkpoint_loads_at_tp2_with_transformers_logits(tiny_models, tmp_path):
    hf_dir = tiny_models["llama"]
    assert run_tool("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", tmp_path / "mg").returncode == 0
    input_ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(4))
    reference = hf_logits(hf_dir, input_ids)
    for logits in run_ranks(load_logits, 2, str(tmp_path / "mg"), 2, input_ids):
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def test_bad_inputs_exit_nonzero_naming_the_problem(tiny_models, tmp_path):
    missing = run_tool("convert_hf_to_megatron.py", "--hf", tmp_path / "nowhere", "--out", tmp_path / "out")
    assert missing.returncode == 2 and "config.json: missing" in missing.stderr

    unknown = tmp_path / "gpt2"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    result = run_tool("convert_hf_to_megatron.py", "--hf", unknown, "--out", tmp_path / "out")
    assert result.returncode == 2 and "model_type 'gpt2' has no builder mapping" in result.stderr

    hf_dir = tiny_models["qwen3"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    state = load_file(hf_dir / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(broken / "model.safetensors"))
    result = run_tool("convert_hf_to_megatron.py", "--hf", broken, "--out", tmp_path / "out")
    assert result.returncode == 2 and "'model.layers.1.self_attn.k_proj.weight'" in result.stderr

    state = load_file(hf_dir / "model.safetensors")
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"][
        :, :-1
    ].contiguous()
    save_file(state, str(broken / "model.safetensors"))
    result = run_tool("convert_hf_to_megatron.py", "--hf", broken, "--out", tmp_path / "out2")
    assert result.returncode == 2 and "decoder.layers.0.mlp.linear_fc2.weight" in result.stderr

    no_meta = run_tool(
        "convert_megatron_to_hf.py", "--megatron", tmp_path, "--out", tmp_path / "x", "--hf-config", hf_dir
    )
    assert no_meta.returncode == 2 and "megatron_rl.json: missing" in no_meta.stderr

"""tools/convert_*: HF -> Megatron -> HF is bit-exact; converted checkpoints reshard on load;
bad input exits non-zero naming the file or tensor.

The tools run as their command line runs them (`main(argv)`, its exit code, what it prints), in
a rank forked from the test's forkserver (`run_tools`) instead of a fresh interpreter each (a
converter process spends ~10 s importing torch and megatron-core on the 2-core machine); one
test runs each tool as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config import Architecture
from tests.support.ranks import gather_vocab, hf_logits
from tests.support.spawn import run_ranks
from tests.support.tools import TOOLS, run_tools


def run_tool_process(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *map(str, args)], capture_output=True, text=True, timeout=300
    )


def both_ways(hf_dir: Path, work: Path, *extra) -> list[tuple]:
    return [
        ("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", work / "mg", *extra),
        ("convert_megatron_to_hf.py", "--megatron", work / "mg", "--out", work / "hf", "--hf-config", hf_dir),
    ]


def convert_both_ways(hf_dir: Path, work: Path, *extra) -> tuple[dict, dict, subprocess.CompletedProcess]:
    to_mg, back = run_tools(*both_ways(hf_dir, work, *extra))
    assert to_mg.returncode == 0, to_mg.stderr
    assert back.returncode == 0, back.stderr
    return load_file(hf_dir / "model.safetensors"), load_file(work / "hf" / "model.safetensors"), to_mg


def assert_bit_exact(original: dict, restored: dict):
    assert set(original) == set(restored)
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name


# glm4_moe's and deepseek_v3's round trip is test_sigmoid_router_checkpoint_at_a_layout_*: converted, loaded at each layout
# and written back as HF (megatron_to_hf, the MG -> HF tool's function), bit-exact
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_round_trip_is_bit_exact(family, tiny_models, tmp_path):
    original, restored, to_mg = convert_both_ways(tiny_models[family], tmp_path)
    assert_bit_exact(original, restored)
    assert "GPT model" in to_mg.stdout and "wrote" in to_mg.stdout
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("tp,ep,pp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_sigmoid_router_checkpoint_at_a_layout_gives_back_every_hf_tensor_and_transformers_logits(
    family, tiny_models, tmp_path_factory, tp, ep, pp
):
    """A converted GLM-4.5-style checkpoint (q/k/v bias, a dense first layer, shared experts, the
    router's expert bias: a buffer) or DeepSeek-V3-style one (multi-latent attention's
    projections and latent norms, YaRN, likewise routed) loaded at TP=2, EP=2 or PP=2: the ranks'
    tensors written back as HF are the original ones bit for bit (the expert bias among them), and
    the last stage's logits are transformers' (and one process's)."""
    hf_dir = tiny_models[family]
    checkpoint, input_ids, reference = converted_with_reference(hf_dir, tmp_path_factory)
    original = load_file(hf_dir / "model.safetensors")
    assert original["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    ranks = run_ranks(load_at_layout, tp * ep * pp, str(checkpoint), tp, ep, pp, input_ids)
    written = {}
    for hf_tensors, logits in ranks:
        for name, tensor in hf_tensors.items():
            assert torch.equal(written.setdefault(name, tensor), tensor), name  # replicas agree
        if logits is not None:
            torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    assert sum(logits is not None for _, logits in ranks) == tp * ep
    assert_bit_exact(original, written)
    if (tp, ep, pp) == (1, 1, 2):
        (alone,) = run_ranks(load_at_layout, 1, str(checkpoint), 1, 1, 1, input_ids)
        torch.testing.assert_close(ranks[-1][1], alone[1], atol=1e-5, rtol=0)


_CONVERTED: dict[Path, tuple[Path, torch.Tensor, torch.Tensor]] = {}


def converted_with_reference(hf_dir: Path, tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """(The converted checkpoint of `hf_dir`, input ids [2, 20], transformers' logits of them),
    converted by the tool once per process and model (read only by the tests that share it)."""
    if hf_dir not in _CONVERTED:
        out = tmp_path_factory.mktemp("converted") / "mg"
        (converted,) = run_tools(("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", out))
        assert converted.returncode == 0, converted.stderr
        input_ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(4))
        _CONVERTED[hf_dir] = (out, input_ids, hf_logits(hf_dir, input_ids))
    return _CONVERTED[hf_dir]


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
    (converted,) = run_tools(("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", tmp_path / "mg"))
    assert converted.returncode == 0, converted.stderr
    input_ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(4))
    reference = hf_logits(hf_dir, input_ids)
    for logits in run_ranks(load_logits, 2, str(tmp_path / "mg"), 2, input_ids):
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def test_bad_inputs_exit_nonzero_naming_the_problem(tiny_models, tmp_path):
    missing = run_tool_process(
        "convert_hf_to_megatron.py", "--hf", tmp_path / "nowhere", "--out", tmp_path / "out"
    )
    assert missing.returncode == 2 and "config.json: missing" in missing.stderr  # the tool as a process

    unknown = tmp_path / "gpt2"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    hf_dir = tiny_models["qwen3"]
    missing_tensor = tmp_path / "missing_tensor"
    missing_tensor.mkdir()
    (missing_tensor / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    state = load_file(hf_dir / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(missing_tensor / "model.safetensors"))
    wrong_shape = tmp_path / "wrong_shape"
    wrong_shape.mkdir()
    (wrong_shape / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    state = load_file(hf_dir / "model.safetensors")
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"][
        :, :-1
    ].contiguous()
    save_file(state, str(wrong_shape / "model.safetensors"))
    results = run_tools(
        ("convert_hf_to_megatron.py", "--hf", unknown, "--out", tmp_path / "out"),
        ("convert_hf_to_megatron.py", "--hf", missing_tensor, "--out", tmp_path / "out"),
        ("convert_hf_to_megatron.py", "--hf", wrong_shape, "--out", tmp_path / "out2"),
        ("convert_megatron_to_hf.py", "--megatron", tmp_path, "--out", tmp_path / "x", "--hf-config", hf_dir),
    )
    expected = [
        "model_type 'gpt2' has no builder mapping",
        "'model.layers.1.self_attn.k_proj.weight'",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "megatron_rl.json: missing",
    ]
    for result, message in zip(results, expected, strict=True):
        assert result.returncode == 2 and message in result.stderr, (message, result.stderr)


def bfloat16_copy(hf_dir: Path, out: Path) -> Path:
    """The HF model in `hf_dir` with bfloat16 tensors (config and tokenizer copied)."""
    out.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((hf_dir / name).read_bytes())
    state = {k: v.to(torch.bfloat16) for k, v in load_file(hf_dir / "model.safetensors").items()}
    save_file(state, str(out / "model.safetensors"))
    return out


def test_bfloat16_checkpoints_stay_bfloat16_and_load_into_a_float32_model(tiny_models, tmp_path):
    hf_dir = bfloat16_copy(tiny_models["qwen3_moe"], tmp_path / "bf16")
    original, restored, _ = convert_both_ways(hf_dir, tmp_path)
    assert_bit_exact(original, restored)
    dtypes = run_ranks(checkpoint_dtypes, 1, str(tmp_path / "mg" / "model"))[0]
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
    loaded = run_ranks(load_converted, 1, str(tmp_path / "mg"))[0]
    from megatron_rl.conversion.hf_mapping import hf_to_megatron

    arch = Architecture(**json.loads((tmp_path / "mg" / "megatron_rl.json").read_text())["architecture"])
    for name, tensor in hf_to_megatron(original, arch).items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], tensor.float()), name


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_te_layout_checkpoint_converts_to_hf(family, tiny_models, tmp_path):
    """A checkpoint written by a TE-spec MoE model (pre_mlp_layernorm.weight, TENorm extra state;
    with multi-latent attention the q/kv latents' norms fused into the up-projections, a dense
    first layer's pre-MLP norm into linear_fc1) converts back to the HF tensors it was loaded from."""
    hf_dir = tiny_models[family]
    run_ranks(save_te_layout_checkpoint, 1, str(hf_dir), str(tmp_path / "te"))
    (back,) = run_tools(
        (
            "convert_megatron_to_hf.py",
            "--megatron",
            tmp_path / "te",
            "--out",
            tmp_path / "hf",
            "--hf-config",
            hf_dir,
        )
    )
    assert back.returncode == 0, back.stderr
    assert_bit_exact(
        load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    )


def test_conversion_holds_no_copy_of_the_model(tmp_path):
    """Peak anonymous memory of each direction against the checkpoint's bytes (a 2-layer MoE,
    bfloat16, 40 MB): HF -> megatron holds only the fused q/k/v (the safetensors are
    memory-mapped; the converter of aabdc61 measured 7x: an fp32 model plus clones); megatron ->
    HF holds the checkpoint once, in its dtype (aabdc61: 5.6x)."""
    from megatron_rl.models.tiny import make_tiny_model

    fp32 = make_tiny_model("qwen3_moe", tmp_path / "fp32", seed=1, hidden_size=1024, tokenizer="char")
    hf_dir = bfloat16_copy(fp32, tmp_path / "bf16")
    checkpoint_bytes = (hf_dir / "model.safetensors").stat().st_size
    to_megatron, to_hf = run_ranks(conversion_peaks, 1, str(hf_dir), str(tmp_path))[0]
    assert to_megatron < 0.5 * checkpoint_bytes, (to_megatron, checkpoint_bytes)
    assert to_hf < 1.5 * checkpoint_bytes, (to_hf, checkpoint_bytes)
    assert_bit_exact(
        load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    )


def load_at_layout(rank, world_size, checkpoint, tp, ep, pp, input_ids):
    """(The HF tensors of what this rank holds, the full-vocabulary logits on the last pipeline
    stage else None) of a converted checkpoint loaded at (tp, ep, pp); the stages hand the hidden
    states on by send/recv."""
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_rl import parallel
    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters

    arch = Architecture(**json.loads((Path(checkpoint) / "megatron_rl.json").read_text())["architecture"])
    parallel.initialize_model_parallel(tp=tp, ep=ep, pp=pp)
    model = build_gpt_model(arch, tp=tp, ep=ep, pp=pp)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(Path(checkpoint) / "model")))
    model.eval()
    hf = megatron_to_hf(gather_full_parameters(model), arch, partial=True)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    hidden_shape = (input_ids.shape[1], input_ids.shape[0], arch.hidden_size)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        if stage > 0:
            received = torch.empty(hidden_shape)
            torch.distributed.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(received)
        out = model(input_ids, positions, attention_mask=None)
        if not parallel_state.is_pipeline_last_stage():
            torch.distributed.send(out, dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return hf, None
    return hf, gather_vocab(out)


def checkpoint_dtypes(rank, world_size, dist_dir):
    from megatron.core import dist_checkpointing

    return {key: meta.dtype for key, meta in dist_checkpointing.load_tensors_metadata(dist_dir).items()}


def load_converted(rank, world_size, checkpoint):
    """A float32 GPT model loaded from a converted checkpoint with load_initial_weights."""
    from megatron_rl import parallel
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import full_parameters
    from megatron_rl.trainer.weights import load_initial_weights

    arch = Architecture(**json.loads((Path(checkpoint) / "megatron_rl.json").read_text())["architecture"])
    parallel.initialize_model_parallel()
    model = build_gpt_model(arch, dtype="float32")
    load_initial_weights(model, checkpoint, arch)
    return full_parameters(model)


def save_te_layout_checkpoint(rank, world_size, hf_dir, out):
    from megatron.core import dist_checkpointing

    from megatron_rl import parallel
    from megatron_rl.conversion import checkpoint_io as io
    from megatron_rl.conversion.hf_mapping import hf_to_megatron
    from megatron_rl.models.sharding import load_full_state_dict
    from tests.support.te_standins import build_te_style_model

    arch = io.read_architecture(Path(hf_dir))
    parallel.initialize_model_parallel()
    model = build_te_style_model(arch)
    load_full_state_dict(model, hf_to_megatron(io.read_hf_state_dict(Path(hf_dir)), arch))
    keys = {entry.key for entry in model.sharded_state_dict().values()}
    if arch.multi_latent_attention:  # per-layer keys (a dense first layer)
        assert {"decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
                "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight"} <= keys  # fmt: skip
    else:
        assert "decoder.layers.pre_mlp_layernorm.weight" in keys  # the TE MoE layout
    (Path(out) / io.MODEL_DIR).mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(Path(out) / io.MODEL_DIR))
    io.write_meta(Path(out), arch, False, hf_dir)


def conversion_peaks(rank, world_size, hf_dir, work):
    """Peak extra anonymous bytes of hf_to_checkpoint and checkpoint_to_hf, in this process."""
    from megatron_rl.conversion.convert import checkpoint_to_hf, hf_to_checkpoint
    from tests.support.process_memory import peak_anonymous_memory, release_freed_memory

    work = Path(work)
    release_freed_memory()
    # Once unmeasured: the first save and load import and set up what any later one reuses.
    hf_to_checkpoint(Path(hf_dir), work / "warm")
    checkpoint_to_hf(work / "warm", work / "warm_hf", Path(hf_dir))
    with peak_anonymous_memory() as to_megatron:
        hf_to_checkpoint(Path(hf_dir), work / "mg")
    with peak_anonymous_memory() as to_hf:
        checkpoint_to_hf(work / "mg", work / "back", Path(hf_dir))
    return to_megatron.extra, to_hf.extra

"""Megatron models built from HF configs give the logits of `transformers` on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import hf_to_megatron
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict
from tests.support.ranks import gather_vocab, hf_logits, model_logits
from tests.support.spawn import run_ranks

LAYOUTS = {
    "qwen3": [(1, 1), (2, 1)], "llama": [(1, 1), (2, 1)], "qwen3_moe": [(1, 1), (2, 1), (1, 2)],
    "glm4_moe": [(1, 1), (2, 1), (1, 2)], "deepseek_v3": [(1, 1), (2, 1)],
}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_logits_match_transformers(family, tiny_models):
    """A right-padded batch: row 0 is full, row 1 has 14 tokens then padding; each row's real
    tokens match transformers run on that row alone."""
    assert_padded_logits_match_transformers(tiny_models[family], LAYOUTS[family])


def test_latent_attention_without_q_lora_or_yarn_with_rope_halves_matches_transformers(tmp_path):
    """DeepSeek-V3's other attention settings (Moonlight's): one full query projection
    (q_lora_rank null), plain RoPE, and RoPE channels stored as halves (rope_interleave false,
    which conversion interleaves for megatron); one process, a right-padded batch."""
    from megatron_rl.models.tiny import make_tiny_model

    overrides = dict(q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 5e4})
    directory = make_tiny_model("deepseek_v3", tmp_path / "plain_q", seed=5, tokenizer="char", config_overrides=overrides)
    arch = assert_padded_logits_match_transformers(directory, [(1, 1)], bias_control=False)
    assert arch.q_lora_rank is None and arch.rope_halves and arch.rope_yarn is None


def assert_padded_logits_match_transformers(directory, layouts, bias_control: bool = True) -> Architecture:
    """test_logits_match_transformers for the HF model in `directory` at each (tp, ep) of `layouts`
    (and, with `bias_control`, that a zeroed expert bias changes them); its architecture."""
    family = json.loads((directory / "config.json").read_text())["model_type"]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    input_ids = torch.randint(1, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    input_ids[1, 14:] = 0  # the tokenizer's pad id
    row0 = hf_logits(directory, input_ids[:1])[0]
    row1 = hf_logits(directory, input_ids[1:, :14])[0]
    assert row0.abs().mean() > 1e-2
    for tp, ep in layouts:
        for logits in run_ranks(model_logits, tp * ep, arch, full, tp, ep, input_ids):
            torch.testing.assert_close(logits[0], row0, atol=1e-4, rtol=0, msg=f"{family} tp={tp} ep={ep}")
            torch.testing.assert_close(
                logits[1, :14], row1, atol=1e-4, rtol=0, msg=f"{family} tp={tp} ep={ep}"
            )
    if arch.moe_expert_bias and bias_control:  # the comparison sees the router's bias (a buffer): without it, other experts
        unbiased = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in full.items()}
        (logits,) = run_ranks(model_logits, 1, arch, unbiased, 1, 1, input_ids)
        assert (logits[0] - row0).abs().max() > 1e-3
    return arch


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_packed_thd_logits_match_transformers_per_sequence(family, tiny_models):
    """Sequences of different lengths packed in one row (with CP-style tail padding) give each
    sequence's own transformers logits."""
    directory = tiny_models[family]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    lengths = [7, 19, 1, 12, 8]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()  # loaded once
    for tp, ep in LAYOUTS[family]:
        for packed, separate, sequences in run_ranks(
            packed_logits, tp * ep, arch, full, lengths, tp, ep, 3
        ):
            for got, alone, ids in zip(packed, separate, sequences):
                with torch.no_grad():
                    torch.testing.assert_close(got, hf(ids[None]).logits[0], atol=1e-4, rtol=0)
                if alone is not None:
                    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,tp,ep", [("qwen3", 1, 1), ("glm4_moe", 1, 2), ("deepseek_v3", 2, 1)])
def test_value_model_scores_as_transformers_and_a_head(family, tiny_models, tp, ep):
    """The critic on each backbone: the value model (the HF backbone converted, a random head)
    gives, for each real token of a right-padded batch, transformers' final hidden state (after
    the last norm) times the head plus its bias; glm4_moe at EP = 2 (each rank half the experts),
    deepseek_v3 (multi-latent attention) at TP = 2."""
    directory = tiny_models[family]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    backbone = {k: v for k, v in hf_to_megatron(load_file(directory / "model.safetensors"), arch).items()
                if not k.startswith("output_layer.")}  # fmt: skip
    generator = torch.Generator().manual_seed(8)
    head = {"value_head.weight": torch.randn(1, arch.hidden_size, generator=generator) * 0.3,
            "value_head.bias": torch.randn(1, generator=generator)}  # fmt: skip
    input_ids = torch.randint(1, arch.vocab_size, (2, 24), generator=generator)
    input_ids[1, 14:] = 0
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [hf.model(input_ids[:1]).last_hidden_state[0], hf.model(input_ids[1:, :14]).last_hidden_state[0]]
    expected = [row @ head["value_head.weight"][0] + head["value_head.bias"] for row in rows]
    assert expected[0].std() > 0.1
    for values in run_ranks(model_values, tp * ep, arch, {**backbone, **head}, tp, ep, input_ids):
        torch.testing.assert_close(values[0], expected[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(values[1, :14], expected[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 2)])
def test_trainer_path_logprobs_match_transformers_per_token(tiny_models, tp, cp):
    """The policy trainer's per-token log-probabilities for a packed, CP-sliced grid (the shift in
    trainer/batches.py included) equal transformers' per-sequence log-probabilities of the same
    action tokens, and exactly the action tokens get one."""
    import numpy as np

    from megatron_rl.data.types import TrainingSample

    directory = tiny_models["qwen3"]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    rng = np.random.default_rng(7)
    samples = []
    for length in (9, 23, 2, 14, 31, 6):
        mask = np.zeros(length, dtype=bool)
        mask[min(3, length - 1):] = rng.random(length - min(3, length - 1)) < 0.8  # a prompt, then actions
        samples.append(TrainingSample(token_ids=rng.integers(0, arch.vocab_size, length), loss_mask=mask,
                                      inference_logprobs=np.zeros(length, np.float32), reward=0.0))  # fmt: skip
    got = run_ranks(trainer_path_logprobs, tp * cp, arch, full, samples, 40, tp, cp)[0]
    expected = {}
    for index, sample in enumerate(samples):
        log_p = torch.log_softmax(hf_logits(directory, torch.as_tensor(sample.token_ids)[None])[0], dim=-1)
        for q in range(1, len(sample.token_ids)):
            if sample.loss_mask[q]:
                expected[(index, q)] = float(log_p[q - 1, sample.token_ids[q]])
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-4), key


# Rank functions: module-level, so that the spawned ranks can import them.


def packed_logits(rank, world_size, arch, full, lengths, tp=1, ep=1, pad=0, seed=0):
    """Logits of sequences packed into one THD row (plus `pad` padding tokens), split back per
    sequence, and of each sequence run alone; full vocabulary."""
    from megatron_rl.models.attention import packed_seq_params

    parallel.initialize_model_parallel(tp=tp, ep=ep)
    model = build_gpt_model(arch, tp=tp, ep=ep)
    load_full_state_dict(model, full)
    model.eval()
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, arch.vocab_size, (n,), generator=g) for n in lengths]
    packed = torch.cat(sequences + [torch.zeros(pad, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        out = gather_vocab(
            model(
                packed,
                positions,
                attention_mask=None,
                packed_seq_params=packed_seq_params(cu, packed.shape[1]),
            )
        )[0]
        # Under sequence parallel (MoE at TP>1) a lone sequence must divide by TP to run at all.
        sp = tp if model.config.sequence_parallel else 1
        separate = [
            gather_vocab(model(s[None], torch.arange(len(s))[None], attention_mask=None))[0]
            if len(s) % sp == 0
            else None
            for s in sequences
        ]
    return [out[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], separate, sequences

def model_values(rank, world_size, arch, full, tp, ep, input_ids):
    """Values [batch, seq] of the value model (models/value_model.py) at (tp, ep), eval mode."""
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(tp=tp, ep=ep)
    model = build_value_model(arch, tp=tp, ep=ep)
    load_full_state_dict(model, full)
    model.eval()
    with torch.no_grad():
        return model(input_ids, torch.arange(input_ids.shape[1]).expand_as(input_ids), attention_mask=None)


def trainer_path_logprobs(rank, world_size, arch, full, samples, seq_len, tp=1, cp=1):
    """The policy trainer's own path: pack_into_grid -> policy_batch (shift, CP slice) -> forward ->
    vocab-parallel log-probabilities of batch.targets, on every CP rank; the full rows are put
    back together and each masked log-probability is attributed, from the packer's own
    sample_index / position_ids, to (sample, position of the predicted token). Returns
    {(sample, position): logprob} for every loss-mask token."""
    from megatron.core import parallel_state

    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs
    from megatron_rl.policy.loss import policy_batch

    parallel.initialize_model_parallel(tp=tp, cp=cp)
    model = build_gpt_model(arch, tp=tp, cp=cp)
    load_full_state_dict(model, full)
    model.eval()
    cp_rank, cp_group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
    out = {}
    for mb in pack_into_grid(samples, seq_len, 1, cp)[0]:
        batch = policy_batch(mb, cp_rank, cp)
        with torch.no_grad():
            logits = model(batch.input_ids, batch.position_ids, attention_mask=None,
                           packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.total_tokens))  # fmt: skip
            logprobs, _ = megatron_vocab_parallel_logprobs(logits[0], batch.targets)
        parts = [logprobs, batch.loss_mask.float()]
        if cp > 1:
            gathered = []
            for part in parts:
                chunks = [torch.empty_like(part) for _ in range(cp)]
                torch.distributed.all_gather(chunks, part.contiguous(), group=cp_group)
                gathered.append(torch.cat(chunks))
            parts = gathered
        row_logprobs, row_mask = parts
        for p in torch.nonzero(row_mask).flatten().tolist():  # output p predicts token p + 1
            out[(int(mb.sample_index[p + 1]), int(mb.position_ids[p + 1]))] = float(row_logprobs[p])
    return out

"""What rank-r adapters on every expert add to a training pass of an MoE model whose experts are one
linear each (SequentialMLP: how the policy is built when `lora.target_modules` adapts the experts),
on CPU, where megatron has no grouped expert path (no TransformerEngine).

Reference: the same model, same weights and tokens, with adapters on attention only (the experts
frozen, no adapter GEMMs there). Figure: adapters on attention and every expert's linear_fc1 and
linear_fc2. Both time one forward + backward (the adapters' and the activations' gradients) of one
packed micro-batch; the median of `--repeats` passes. Ratio = figure / reference; also the
overhead per local expert and layer (µs). Run over several expert counts at fixed tokens and
top-k, so each expert's share of the tokens shrinks as the count grows (as at 128 experts, top-8).
The grouped GEMM against one linear per expert is a GPU check (tests/gpu, `expert_adapters`).
Writes benchmarks/results/expert_adapters.json (figure, reference, ratio: the largest expert count).

    python benchmarks/expert_adapters.py [--experts 8 32 64] [--tokens 2048] [--rank 16] [--repeats 5]
"""

from __future__ import annotations

import argparse

import _checkout  # noqa: F401  (tests/support importable)
from _results import write_result  # benchmarks/ is on sys.path when run as a script


def measure(rank, world_size, experts, tokens, lora_rank, repeats):
    from megatron_rl import parallel
    from megatron_rl.config import Architecture
    from tests.support.expert_cost import pass_seconds, per_expert_overhead_us

    parallel.initialize_model_parallel()
    rows = []
    for count in experts:
        arch = Architecture(family="qwen3_moe", hidden_size=256, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=768, vocab_size=1024,
                            num_experts=count, num_experts_per_tok=4, moe_intermediate_size=128,
                            qk_norm=True, max_position_embeddings=tokens)  # fmt: skip
        seconds = pass_seconds(arch, tokens, ["per_expert", "per_expert_adapters"], rank=lora_rank, repeats=repeats)
        rows.append({"experts": count, "tokens_per_expert": tokens * 4 / count,
                     "attention_only_s": seconds["per_expert"], "expert_adapters_s": seconds["per_expert_adapters"],
                     "ratio": seconds["per_expert_adapters"] / seconds["per_expert"],
                     "overhead_us_per_expert_layer": per_expert_overhead_us(arch, seconds, count)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tests.support.spawn import run_ranks

    rows = run_ranks(measure, 1, args.experts, args.tokens, args.rank, args.repeats)[0]
    print(f"{'experts':>8} {'tokens/expert':>14} {'attention only s':>17} {'+ expert adapters s':>20} "
          f"{'ratio':>6} {'µs/expert/layer':>16}")  # fmt: skip
    for row in rows:
        print(f"{row['experts']:>8} {row['tokens_per_expert']:>14.0f} {row['attention_only_s']:>17.4f} "
              f"{row['expert_adapters_s']:>20.4f} {row['ratio']:>6.2f} {row['overhead_us_per_expert_layer']:>16.0f}")  # fmt: skip
    last = rows[-1]
    out = write_result("expert_adapters", last["expert_adapters_s"], last["attention_only_s"], last["ratio"],
                       vars(args), rows=rows)  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

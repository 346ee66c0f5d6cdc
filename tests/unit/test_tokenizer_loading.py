"""models/tokenizer.py: a model directory whose tokenizer is code it ships (tokenizer_config.json's
auto_map, as Moonlight's tiktoken-based tokenization_moonshot.py) loads with model.trust_remote_code
and runs that code; without the key it is refused, naming the key, where transformers would refuse
or quietly substitute a conversion of its own; a directory with a tokenizer.json needs no code.
Offline: the tokenizer class is written here (a character tokenizer numbering code points + 3)."""

from __future__ import annotations

import json
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from megatron_rl.config.model import ModelConfig
from megatron_rl.models.tokenizer import (
    TokenizerError,
    load_tokenizer,
    remote_tokenizer_class,
    vllm_remote_code_args,
)

TOKENIZER_CODE = '''
from transformers import PreTrainedTokenizer


class CodePointTokenizer(PreTrainedTokenizer):
    """Every character is one token: its code point + 3 (0, 1, 2: pad, bos, eos)."""

    model_input_names = ["input_ids", "attention_mask"]
    SPECIAL = ["<pad>", "<s>", "</s>"]

    @property
    def vocab_size(self):
        return 3 + 0x250

    def get_vocab(self):
        return {self._convert_id_to_token(i): i for i in range(self.vocab_size)}

    def _tokenize(self, text, **kwargs):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.SPECIAL.index(token) if token in self.SPECIAL else ord(token) + 3

    def _convert_id_to_token(self, index):
        return self.SPECIAL[index] if index < 3 else chr(index - 3)

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """transformers copies remote code into its modules cache: a temporary one, off sys.path after."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))


def custom_tokenizer_dir(root, model_type: str = "toy_custom", tokenizer_json: bool = False):
    directory = root / f"{model_type}{'_json' if tokenizer_json else ''}"
    directory.mkdir()
    (directory / "tokenization_codepoint.py").write_text(TOKENIZER_CODE)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CodePointTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_codepoint.CodePointTokenizer", None]},
        "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}))  # fmt: skip
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    if tokenizer_json:  # a serialized fast tokenizer: whitespace-split words
        vocab = {"<pad>": 0, "<unk>": 1, "hello": 2, "world": 3}
        fast = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        fast.pre_tokenizer = pre_tokenizers.Whitespace()
        fast.save(str(directory / "tokenizer.json"))
    return directory


def test_remote_tokenizer_code_loads_with_the_key_and_runs_the_directorys_class(tmp_path, modules_cache):
    directory = custom_tokenizer_dir(tmp_path)
    assert remote_tokenizer_class(directory) == "tokenization_codepoint.CodePointTokenizer"
    tokenizer = load_tokenizer(directory, trust_remote_code=True)
    assert type(tokenizer).__name__ == "CodePointTokenizer"
    text = "Moonlight ünd 42"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == [ord(c) + 3 for c in text]
    assert tokenizer.decode([ord(c) + 3 for c in "ok"]) == "ok"


@pytest.mark.parametrize("model_type", ["toy_custom", "deepseek_v3"])
def test_without_the_key_remote_tokenizer_code_is_refused_naming_it(tmp_path, model_type):
    """An unknown model type: transformers itself would refuse; deepseek_v3 (Moonlight's): it would
    skip the class and convert the vocabulary files its own way. Either way: refused, no code run."""
    directory = custom_tokenizer_dir(tmp_path, model_type)
    with pytest.raises(TokenizerError, match=r"auto_map AutoTokenizer: tokenization_codepoint.CodePointTokenizer.*"
                       r"Set model.trust_remote_code: true to run tokenization_codepoint.py"):  # fmt: skip
        load_tokenizer(directory, trust_remote_code=False)


def test_a_tokenizer_json_beside_the_code_loads_without_it_or_is_refused_by_transformers_naming_the_key(tmp_path):
    """With a tokenizer.json, a known model type (deepseek_v3) loads it without running code; an
    unknown one transformers refuses without trust_remote_code: our error names the key."""
    known = custom_tokenizer_dir(tmp_path, "deepseek_v3", tokenizer_json=True)
    tokenizer = load_tokenizer(known, trust_remote_code=False)
    assert type(tokenizer).__name__ != "CodePointTokenizer"
    assert tokenizer("hello world hello", add_special_tokens=False)["input_ids"] == [2, 3, 2]
    unknown = custom_tokenizer_dir(tmp_path, "toy_custom", tokenizer_json=True)
    with pytest.raises(TokenizerError, match=r"needs to run code from this directory.*set model.trust_remote_code: true"):
        load_tokenizer(unknown, trust_remote_code=False)


def test_bad_directories_are_named(tmp_path):
    with pytest.raises(TokenizerError, match=r"missing: no such directory"):
        load_tokenizer(tmp_path / "missing", trust_remote_code=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("{auto_map")
    with pytest.raises(TokenizerError, match=r"broken/tokenizer_config.json: not JSON"):
        load_tokenizer(broken, trust_remote_code=False)


def test_the_config_key_defaults_off_and_gives_vllm_its_flag():
    model = ModelConfig(hf_config="/x", seq_len=64)
    assert model.trust_remote_code is False and vllm_remote_code_args(model) == []
    assert vllm_remote_code_args(model.model_copy(update=dict(trust_remote_code=True))) == ["--trust-remote-code"]

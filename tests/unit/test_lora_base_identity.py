"""The base model's identity in a LoRA checkpoint (transforms/lora_base.py): the fingerprint
reads names, sizes and the first and last MiB of weight files only, and `check_base` /
`check_settings` / the checkpoint's own check refuse another base or other settings, naming both."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_rl.config import LoraConfig
from megatron_rl.transforms.lora_base import (
    FINGERPRINT_BYTES,
    BaseMismatch,
    base_identity,
    check_base,
    check_settings,
    fingerprint,
    lora_meta,
)

MIB = FINGERPRINT_BYTES


def make_base(directory: Path, size: int = 3 * MIB) -> Path:
    directory.mkdir(parents=True)
    (directory / "model-00001-of-00002.safetensors").write_bytes((bytes(range(251)) * (size // 251 + 1))[:size])
    (directory / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 1000)
    (directory / "config.json").write_text('{"model_type": "qwen3"}')
    (directory / "tokenizer.json").write_text("{}")
    return directory


def rewrite(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_the_fingerprint_names_the_weights_not_the_path_or_side_files(tmp_path):
    base = make_base(tmp_path / "base")
    print_ = fingerprint(base)
    assert print_.startswith("sha256:") and len(print_) == len("sha256:") + 64
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(base, copy)
    assert fingerprint(copy) == print_  # a moved copy is the same base
    (copy / "tokenizer.json").write_text('{"changed": true}')  # not a weight file
    (copy / "README.md").write_text("notes")
    assert fingerprint(copy) == print_


@pytest.mark.parametrize(
    "change",
    ["first MiB", "last MiB", "size", "renamed", "extra shard", "dist checkpoint metadata"],
)
def test_the_fingerprint_sees_changed_weight_files(tmp_path, change):
    base = make_base(tmp_path / "base")
    (base / "model").mkdir()
    (base / "model" / ".metadata").write_bytes(b"layout")
    before = fingerprint(base)
    shard = base / "model-00001-of-00002.safetensors"
    if change == "first MiB":
        rewrite(shard, 10, b"\xff\xff")
    elif change == "last MiB":
        rewrite(shard, shard.stat().st_size - 5, b"\xff")
    elif change == "size":
        shard.write_bytes(shard.read_bytes() + b"\x00")
    elif change == "renamed":
        shard.rename(base / "model-00001-of-00003.safetensors")
    elif change == "extra shard":
        (base / "model" / "__0_0.distcp").write_bytes(b"\x02" * 10)
    else:
        (base / "model" / ".metadata").write_bytes(b"LAYOUT")
    assert fingerprint(base) != before


def test_what_the_fingerprint_does_not_read(tmp_path):
    """A change confined to the middle of a file, its size unchanged, is not seen (documented):
    2 MiB read per file is what keeps it cheap for a 60 GB checkpoint."""
    base = make_base(tmp_path / "base")
    before = fingerprint(base)
    rewrite(base / "model-00001-of-00002.safetensors", MIB + MIB // 2, b"\xff")
    assert fingerprint(base) == before


def test_no_base_directory_or_no_weights_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"value.model.checkpoint: .*missing is not a directory"):
        fingerprint(tmp_path / "missing", "value.model.checkpoint")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"model.checkpoint: .*empty holds no weight files"):
        fingerprint(tmp_path / "empty")


def test_check_base_passes_the_same_base_and_refuses_another_naming_both(tmp_path):
    base = make_base(tmp_path / "base")
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    saved = base_identity(str(base), "model.checkpoint", seed=1)
    assert saved["checkpoint"] == str(base.absolute())
    check_base(saved, base_identity(str(copy), "model.checkpoint", seed=1), "ckpt/step_00000003")
    rewrite(copy / "model-00001-of-00002.safetensors", 0, b"\x07")
    with pytest.raises(BaseMismatch) as error:
        check_base(saved, base_identity(str(copy), "model.checkpoint", seed=1), "ckpt/step_00000003")
    message = str(error.value)
    assert message.startswith("ckpt/step_00000003: its LoRA adapters were trained on the base " + str(base.absolute()))
    assert f"but model.checkpoint is now {copy.absolute()}" in message and saved["fingerprint"] in message


def test_a_missing_base_or_another_random_base_is_refused(tmp_path):
    base = make_base(tmp_path / "base")
    saved = base_identity(str(base), "value.model.checkpoint", seed=1)
    random = base_identity(None, "value.model.checkpoint", seed=1)
    with pytest.raises(BaseMismatch, match=r"value.model.checkpoint is now a random initialisation \(seed 1, "):
        check_base(saved, random, "step")
    with pytest.raises(BaseMismatch, match=r"trained on the base a random initialisation .* now " + str(base.absolute())):
        check_base(random, saved, "step")
    check_base(random, base_identity(None, "value.model.checkpoint", seed=1), "step")
    with pytest.raises(BaseMismatch, match=r"seed 1, value.model.checkpoint null\), but .* \(seed 2"):
        check_base(random, base_identity(None, "value.model.checkpoint", seed=2), "step")


def test_other_lora_settings_are_refused_naming_the_keys():
    identity = base_identity(None, "model.checkpoint", seed=0)
    saved = lora_meta(LoraConfig(rank=4, alpha=8.0), "lora", identity)
    check_settings(saved, lora_meta(LoraConfig(rank=4, alpha=8.0), "lora", identity), "step")
    with pytest.raises(ValueError, match=r"trained with lora.rank 4, lora.alpha 8.0; this run has lora.rank 8, lora.alpha 16.0"):
        check_settings(saved, lora_meta(LoraConfig(rank=8, alpha=16.0), "lora", identity), "step")
    other = lora_meta(LoraConfig(rank=4, alpha=8.0, target_modules=["linear_qkv"]), "value.lora", identity)
    with pytest.raises(ValueError, match=r"value.lora.target_modules \['linear_qkv'\]"):
        check_settings(saved, other, "step")


def test_a_lora_checkpoint_is_refused_by_a_run_without_lora():
    from megatron_rl.config.layout import LoraPlan
    from megatron_rl.transforms.lora_transform import LoraTransform
    from megatron_rl.transforms.plan import check_saved_transforms

    identity = base_identity(None, "value.model.checkpoint", seed=0)
    saved = lora_meta(LoraConfig(rank=4), "value.lora", identity)
    with pytest.raises(ValueError, match=r"step: a LoRA checkpoint \(value.lora: adapters of the base None.*without value.lora"):
        check_saved_transforms({"lora": saved}, [], Path("step"))
    plan = LoraPlan(key="value.lora", rank=4, alpha=16.0, target_modules=list(LoraConfig(rank=4).target_modules),
                    adapts_experts=False)  # fmt: skip
    lora = LoraTransform(plan, 0, identity)
    check_saved_transforms({}, [lora], Path("step"))  # a checkpoint with every tensor loads into a LoRA run as before
    check_saved_transforms({"lora": saved}, [lora], Path("step"))  # its own base and settings
    other = LoraTransform(plan.model_copy(update={"rank": 8}), 0, identity)
    with pytest.raises(ValueError, match=r"trained with value.lora.rank 4; this run has value.lora.rank 8"):
        check_saved_transforms({"lora": saved}, [other], Path("step"))

"""Prompt datasets: JSONL files, Parquet files and Hugging Face `datasets` directories saved to
disk (`Dataset.save_to_disk`; a `DatasetDict` is a directory per split: name the split's).

`load_rows(path, prompt_field=None, answer_field=None)` returns the rows as `{"prompt", "answer"}`
plus the record's `data_source` and `extra_info` when it has them. A field is a dotted path into
the record (`reward_model.ground_truth`); by default the prompt is `prompt` and the answer is
`answer` or, failing that, verl's `reward_model.ground_truth`, so verl's schema reads as it is. A
prompt is a string (the user message) or a list of messages (`{"role", "content"}`, roles system,
user, assistant, tool: a system prompt, few-shot turns); an answer is a string or a number. A
bad record is a ValueError naming the file, the row (1-based) and the field; rows keep the
file's order, so (seed, index) picks the same row on every run (`ShuffledRows`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")
ANSWER_FIELDS = ("answer", "reward_model.ground_truth")  # ours, then verl's
EXTRA_FIELDS = ("data_source", "extra_info")
_MISSING = object()


def read_records(path: Path) -> Iterator[tuple[int, object]]:
    """(row number, record) of a JSONL or Parquet file or a saved `datasets` directory."""
    if path.is_dir():
        yield from _saved_dataset(path)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # noqa: BLE001  (pyarrow raises several kinds; the message names the file)
            raise ValueError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        yield from enumerate(table.to_pylist(), 1)
    else:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from None


def _saved_dataset(path: Path) -> Iterator[tuple[int, object]]:
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"{path}: not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(dataset, DatasetDict):
        raise ValueError(
            f"{path}: a DatasetDict of splits {sorted(dataset)}; give one split's directory, e.g. {path / sorted(dataset)[0]}"
        )
    assert isinstance(dataset, Dataset)
    yield from enumerate(dataset, 1)


def _field(record: dict, dotted: str):
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _prompt(value, where: str) -> str | list[dict]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: a string or a non-empty list of messages, got {type(value).__name__}")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {index} must be {{'role': one of {list(ROLES)}, 'content': a string}}, "
                             f"got {message!r:.200}")  # fmt: skip
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def load_rows(path: str | Path, prompt_field: str | None = None, answer_field: str | None = None) -> list[dict]:
    """The dataset's rows (the module docstring); ValueError naming the file, row and field."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"orchestrator.dataset: {path} does not exist")
    prompt_field = prompt_field or "prompt"
    answer_fields = (answer_field,) if answer_field else ANSWER_FIELDS
    rows = []
    for number, record in read_records(path):
        where = f"{path}: row {number}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a record must be an object with fields, got {type(record).__name__}")
        prompt = _field(record, prompt_field)
        if prompt is _MISSING:
            raise ValueError(f"{where}: no field {prompt_field!r} (the prompt)")
        name = next((field for field in answer_fields if _field(record, field) is not _MISSING), None)
        if name is None:
            raise ValueError(f"{where}: no answer field (looked for {list(answer_fields)})")
        answer = _field(record, name)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(f"{where} field {name!r}: the answer must be a string or a number, got {answer!r:.200}")
        row = {"prompt": _prompt(prompt, f"{where} field {prompt_field!r}"), "answer": str(answer)}
        row.update({key: record[key] for key in EXTRA_FIELDS if key in record})
        rows.append(row)
    if not rows:
        raise ValueError(f"orchestrator.dataset: {path} has no rows")
    return rows

"""Prompt datasets (envs/datasets.py): JSONL, Parquet and saved `datasets` directories give the
same rows, verl's schema reads as it is, fields map by dotted paths, prompts are text or
messages rendered by the chat template, every bad record is named by file, row and field, and a
row depends only on (seed, index)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

from megatron_rl.envs import make_environment
from megatron_rl.envs.datasets import load_rows
from megatron_rl.orchestrator.rollouts import PromptEncoder

VERL = [
    {"data_source": "gsm8k", "prompt": [{"role": "system", "content": "Reason step by step."},
                                        {"role": "user", "content": "What is 2 + 3?"}],
     "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 0, "split": "train"}},
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1/2 + 1/4?"}],
     "reward_model": {"style": "rule", "ground_truth": "3/4"}, "extra_info": {"index": 1, "split": "train"}},
]  # fmt: skip


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_parquet_and_a_saved_dataset_give_the_same_rows_of_verls_schema(tmp_path):
    jsonl = write_jsonl(tmp_path / "train.jsonl", VERL)
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL), parquet)
    saved = tmp_path / "saved"
    Dataset.from_list(VERL).save_to_disk(str(saved))
    expected = [
        {"prompt": VERL[0]["prompt"], "answer": "5", "data_source": "gsm8k", "extra_info": {"index": 0, "split": "train"}},
        {"prompt": VERL[1]["prompt"], "answer": "3/4", "data_source": "gsm8k", "extra_info": {"index": 1, "split": "train"}},
    ]  # fmt: skip
    for path in (jsonl, parquet, saved):
        assert load_rows(path) == expected, path
    DatasetDict({"train": Dataset.from_list(VERL), "test": Dataset.from_list(VERL)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"a DatasetDict of splits \['test', 'train'\]; give one split's directory"):
        load_rows(tmp_path / "dict")
    assert load_rows(tmp_path / "dict" / "test") == expected


def test_text_prompts_numbers_as_answers_and_a_field_mapping(tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "2+2?", "answer": 4}, {"prompt": "0.5*2?", "answer": 1.0}])
    assert load_rows(plain) == [{"prompt": "2+2?", "answer": "4"}, {"prompt": "0.5*2?", "answer": "1.0"}]
    mapped = write_jsonl(tmp_path / "mapped.jsonl", [{"question": "3*3?", "solution": {"final": "9"}, "answer": "x"}])
    assert load_rows(mapped, "question", "solution.final") == [{"prompt": "3*3?", "answer": "9"}]
    env = make_environment("math", str(mapped), args={"prompt_field": "question", "answer_field": "solution.final"})
    assert env.prompt(env.row(0)) == "3*3?" and env.step(env.row(0), ["\\boxed{9}"]).reward == 1.0


@pytest.mark.parametrize(
    "record,message",
    [
        ([1, 2], r"row 2: a record must be an object with fields, got list"),
        ({"answer": "1"}, r"row 2: no field 'prompt' \(the prompt\)"),
        ({"prompt": "a"}, r"row 2: no answer field \(looked for \['answer', 'reward_model.ground_truth'\]\)"),
        ({"prompt": "a", "answer": {"x": 1}}, r"row 2 field 'answer': the answer must be a string or a number"),
        ({"prompt": "a", "answer": True}, r"row 2 field 'answer': the answer must be a string or a number"),
        ({"prompt": [], "answer": "1"}, r"row 2 field 'prompt': a string or a non-empty list of messages, got list"),
        ({"prompt": 7, "answer": "1"}, r"row 2 field 'prompt': a string or a non-empty list of messages, got int"),
        ({"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"}, r"row 2 field 'prompt': message 0 must be"),
        ({"prompt": [{"role": "user", "content": None}], "answer": "1"}, r"row 2 field 'prompt': message 0 must be"),
    ],
)
def test_a_bad_record_is_named_by_file_row_and_field(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "answer": "1"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl: {message}"):
        load_rows(path)


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"orchestrator.dataset: .*missing.jsonl does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl has no rows"):
        load_rows(tmp_path / "empty.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not JSON"):
        load_rows(tmp_path / "broken.jsonl")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken.parquet: not a readable Parquet file"):
        load_rows(tmp_path / "broken.parquet")
    (tmp_path / "not_saved").mkdir()
    with pytest.raises(ValueError, match=r"not_saved: not a dataset saved with save_to_disk"):
        load_rows(tmp_path / "not_saved")
    calculator = write_jsonl(tmp_path / "calc.jsonl", VERL)
    with pytest.raises(ValueError, match=r"calc.jsonl: row 1: the calculator's prompts are text"):
        make_environment("calculator", str(calculator))


def test_rows_depend_only_on_seed_and_index_and_messages_render_through_the_chat_template(tmp_path, tiny_models):
    records = [{"prompt": [{"role": "system", "content": f"s{i}"}, {"role": "user", "content": f"q{i}"}], "answer": str(i)}
               for i in range(7)]  # fmt: skip
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    first, again = make_environment("math", str(parquet), seed=3), make_environment("math", str(parquet), seed=3)
    order = [first.row(i)["answer"] for i in range(21)]
    assert [again.row(i)["answer"] for i in range(20, -1, -1)] == order[::-1]  # any order of asking: a cursor resumes
    assert sorted(order[:7]) == sorted(order[7:14]) == [str(i) for i in range(7)]  # each epoch every row once
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models["qwen3"]))
    messages = first.prompt(first.row(0))
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert PromptEncoder(tokenizer).prompt(messages) == expected
    assert PromptEncoder(tokenizer).prompt("q0") == PromptEncoder(tokenizer).prompt([{"role": "user", "content": "q0"}])
    system = messages[0]["content"]
    assert messages[0]["role"] == "system" and tokenizer.decode(expected).count(f"system\n{system}") == 1

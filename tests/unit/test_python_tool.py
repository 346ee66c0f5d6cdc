"""The sandboxed Python tool in a rollout: math with messages and `tools: {python: ...}`, the
model's Hermes calls run in the sandbox (envs/sandbox.py), what the code printed comes back as
the template's tool message, and a limit hit is a counted tool error the model reads."""

from __future__ import annotations

import pytest

from megatron_rl.envs import make_environment
from megatron_rl.orchestrator.chat import PromptEncoder
from tests.support.qwen_tokenizer import qwen_tokenizer
from tests.unit.test_chat import SYSTEM, call, completion, roll

pytestmark = pytest.mark.xdist_group("sandbox")  # the sandbox tests count the sandbox's processes


def test_math_with_the_python_tool(tmp_path):
    qwen = qwen_tokenizer()
    dataset = tmp_path / "math.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [SYSTEM, {"role": "user", "content": "What is 6 * 7?"}], "reward_model": {"ground_truth": "42"}}]
    pq.write_table(pa.Table.from_pylist(rows), dataset)
    env = make_environment("math", str(dataset), args={"tools": {"python": {"timeout_s": 2, "memory_mb": 512}},
                                                         "max_turns": 4})  # fmt: skip
    assert env.tool_schemas()[0]["function"]["name"] == "python"
    script = [
        completion(qwen, "<think>\nLet me compute.\n</think>\n\n" + call("python", code="print(6 * 7)")),
        completion(qwen, call("python", code="while True:\n    pass")),
        completion(qwen, call("python", code="import sympy\nprint(sympy.factorint(42))")),
        completion(qwen, "The answer is \\boxed{42}."),
    ]
    member, client = roll(env, PromptEncoder(qwen), script)
    assert member.reward == 1.0 and member.turns == 4
    assert member.tool_calls == 3 and member.tool_errors == 1
    seen = qwen.decode(client.calls[3]["prompt"]).split("<tool_response>")[1:]
    assert seen[0].startswith("\n42\n</tool_response>")
    assert "time limit" in seen[1]
    assert seen[2].startswith("\n{2: 1, 3: 1, 7: 1}\n</tool_response>")  # sympy, read-only from the venv

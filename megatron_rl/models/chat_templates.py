"""Chat templates of the models this project builds (models/tiny.py) and tests with.

`CHATML` is the minimal ChatML of the tiny models: one `<|im_start|>role\\ncontent<|im_end|>\\n`
block per message. `CHATML_TOOLS` is ChatML with what a real chat model's template has: a system
block listing the tools as JSON schemas, calls in the Hermes format (`<tool_call>` JSON
`</tool_call>`, from a message's `tool_calls` or written in its content), tool results as
`<tool_response>` blocks of one user turn, reasoning kept as the model wrote it, and
`enable_thinking=false` opening the answer with an empty `<think></think>`. It renders every
message as it is, never rewriting an earlier one, so a rollout extended by tool messages equals
the render of its whole conversation (orchestrator/chat.py). Real checkpoints bring their own.
"""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHATML_TOOLS = (
    "{%- set ns = namespace(first=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- set ns.first = 1 %}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou can call these functions; their signatures are JSON schemas, one per line:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}"
    "{{- '</tools>\\n\\nCall a function by writing a JSON object with its name and arguments between tags:\\n'"
    " + '<tool_call>\\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\\n</tool_call>'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + function['name'] | tojson + ', \"arguments\": ' }}"
    "{%- if function['arguments'] is string %}{{- function['arguments'] }}"
    "{%- else %}{{- function['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

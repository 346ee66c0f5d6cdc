"""A short supervised warm start of a tiny HF model on a demo task's format (CPU).

    python tools/sft_warm_start.py --model DIR --out DIR [--task reverse|copy|count|tool] [--steps 80] [--lr 3e-3]

`tool` is the calculator environment as the tool demo sets it (`TOOL_TASK`): a two-digit product
asked as "47*83=", answered by calling `<calc>47*83</calc>`, reading `<result>3901</result>` and
writing "3901"; its demonstrations train the two turns of the model and not the observation.

Cross-entropy on the answer tokens (plus the end-of-sequence token) of prompts rendered exactly as
the orchestrator renders them (the tokenizer's chat template, once), rows from a seed that the
RL run does not use. From a random initialisation a tiny model learns the answer *format* in a
minute and then improves under RL, which without a warm start only `count` does
(docs/getting-started/demo.md, "How the task was chosen"). Prints the loss every 10 steps and
writes the model (HF format, tokenizer included) to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megatron_rl.envs import make_environment
from megatron_rl.orchestrator.chat import PromptEncoder

# The tool demo's task: products of two-digit numbers (beyond a tiny model without the tool), one
# call then the answer. environment, environment_args of the run config.
TOOL_TASK = (
    "calculator",
    {"max_turns": 2, "low": 10, "high": 99, "ops": "*", "question": "{a}{op}{b}=", "instruction": ""},
)


def demonstration_tokens(env, encoder: PromptEncoder, row: dict, eos: int) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of `row`'s demonstration as a rollout of it would lay them out: the
    prompt (with the tools) through the chat template, the model's segments (mask 1), text
    observations tokenised as they are and tool messages as the template renders them after the
    model's turn, which ends with `eos` (mask 0), and `eos` after the last segment."""
    prompt, tools = env.prompt(row), env.tool_schemas()
    sequence = encoder.prompt(prompt, tools)
    mask, conversation, turn = [0] * len(sequence), encoder.messages(prompt), []
    for segment, action in env.demonstration(row):
        if isinstance(segment, list):  # tool messages: the model ends its turn, the template renders them
            turn = turn + [eos]
            sequence, mask = sequence + [eos], mask + [1]
            ids, _ = encoder.extend(conversation, turn, segment, tools)
        else:
            ids = encoder.observation(segment)  # plain encoding, no special tokens
            turn = ids if action else turn
        sequence, mask = sequence + ids, mask + [int(action)] * len(ids)
    return sequence + [eos], mask + [1]


def warm_start(model_dir: Path, out: Path, task: str = "reverse", steps: int = 80, lr: float = 3e-3,
               batch_size: int = 64, seed: int = 7_000_001, log=print, environment: str = "procedural",
               environment_args: dict | None = None, target_loss: float | None = None) -> list[float]:  # fmt: skip
    """Returns the loss of every step. `environment`, `task` (its dataset) and `environment_args`
    name the environment whose `demonstration`s are learnt: the model's own segments are trained
    (with the end-of-sequence token), observations are context only, each segment tokenised on
    its own as a rollout does (text as it is; tool messages as the chat template renders them
    after the model's turn, which then ends with the end-of-sequence token, trained). With `target_loss`, training stops early once the mean loss of
    the last 5 steps is below it (the warm start is a threshold effect: a loss gate gives every
    seed a like start, a fixed step count does not)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer


    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    encoder = PromptEncoder(tokenizer)
    env = make_environment(environment, task if environment == "procedural" else None, seed=seed,
                           args=environment_args)  # fmt: skip
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, index = [], 0
    model.train()
    for step in range(steps):
        rows = [env.row(index + i) for i in range(batch_size)]
        index += batch_size
        sequences, masks = [], []
        for row in rows:
            sequence, mask = demonstration_tokens(env, encoder, row, eos)
            sequences.append(sequence)
            masks.append(mask)
        width = max(len(s) for s in sequences)
        ids = torch.tensor([s + [eos] * (width - len(s)) for s in sequences])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logprobs * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        reached = target_loss is not None and len(losses) >= 5 and sum(losses[-5:]) / 5 < target_loss
        if step % 10 == 0 or step == steps - 1 or reached:
            log(f"[sft] step {step} loss {loss.item():.3f}" + (f" (mean of 5 below {target_loss})" if reached else ""))
        if reached:
            break
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--task", default="reverse", choices=["reverse", "copy", "count", "tool"])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    if args.task == "tool":
        environment, environment_args = TOOL_TASK
        warm_start(args.model, args.out, None, args.steps, args.lr, environment=environment,
                   environment_args=environment_args)  # fmt: skip
    else:
        warm_start(args.model, args.out, args.task, args.steps, args.lr)
    return 0

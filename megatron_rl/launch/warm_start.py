"""A short supervised warm start of a tiny HF model on a procedural task's format (CPU).

    python tools/sft_warm_start.py --model DIR --out DIR [--task reverse] [--steps 80] [--lr 3e-3]

Cross-entropy on the answer tokens (plus the end-of-sequence token) of prompts rendered exactly as
the orchestrator renders them (the tokenizer's chat template, once), rows from a seed that the
RL run does not use. From a random initialisation a tiny model learns the answer *format* in a
minute and then improves under RL (measured while developing the demo: reverse rises from 0.44 to
0.9 after 50-80 warm-start steps; without it only `count` rises). Prints the loss every 10 steps
and writes the model (HF format, tokenizer included) to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megatron_rl.envs import make_environment
from megatron_rl.orchestrator.rollouts import PromptEncoder


def warm_start(model_dir: Path, out: Path, task: str = "reverse", steps: int = 80, lr: float = 3e-3,
               batch_size: int = 64, seed: int = 7_000_001, log=print) -> list[float]:  # fmt: skip
    """Returns the loss of every step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer


    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    encoder = PromptEncoder(tokenizer)
    env = make_environment("procedural", task, seed=seed)
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
            prompt = encoder.prompt(env.prompt(row))
            answer = tokenizer.encode(row["answer"], add_special_tokens=False) + [eos]
            sequences.append(prompt + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
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
        if step % 10 == 0 or step == steps - 1:
            log(f"[sft] step {step} loss {loss.item():.3f}")
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
    parser.add_argument("--task", default="reverse", choices=["reverse", "copy", "count"])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    warm_start(args.model, args.out, args.task, args.steps, args.lr)
    return 0

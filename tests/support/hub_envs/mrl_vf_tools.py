"""A taskset whose tasks have a toolset of two tools (`add`, `multiply`), served per rollout over
MCP as verifiers 0.4 serves a `vf.Toolset` (the chat program names them `calc_add`,
`calc_multiply`); the reward checks the final answer, a metric counts the tool results."""

from __future__ import annotations

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @vf.tool
    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.metric
    async def tool_results(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        return [
            CalcTask(CalcData(prompt="What is (2 + 3) * 4? Use the tools.", answer="20"), self.config.task),
            CalcTask(CalcData(prompt="What is (1 + 6) * 3? Use the tools.", answer="21"), self.config.task),
        ]


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    CalcToolset.run()

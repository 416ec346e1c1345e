"""A verifiers taskset made of in-memory question/answer rows, for the verifiers tests.

Also written out as an installed-style taskset module (``__all__`` exports the Taskset) so
``env = "verifiers:<id>"`` can load it the way verifiers loads a taskset package.
"""

from __future__ import annotations

import verifiers.v1 as vf
from pydantic import Field


class QAData(vf.TaskData):
    answer: str


class QATask(vf.Task[QAData]):
    @vf.reward
    async def correct(self, task: QAData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 8)


class QAConfig(vf.TasksetConfig):
    rows: list[tuple[str, str]] = Field(default_factory=list)
    system_prompt_text: str | None = None


class QASet(vf.Taskset[QATask, QAConfig]):
    def load(self):  # type: ignore[no-untyped-def]
        for question, answer in self.config.rows:
            data = QAData(
                prompt=question, answer=answer, system_prompt=self.config.system_prompt_text
            )
            yield QATask(data, self.config.task)


__all__ = ["QASet"]

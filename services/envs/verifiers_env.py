"""Environments of the verifiers library: a ``Taskset`` whose tasks' rewards score plexrl.

A verifiers environment is data and judgement: a ``Taskset`` yields ``Task``s (their
``TaskData``: a prompt, an optional system prompt and whatever the rewards read, such as an
answer), and each task's ``@vf.reward`` functions score a ``Trace`` of the conversation. plexrl
plays the model's part itself, one reply per prompt: :class:`VerifiersEnv` renders a task as
chat messages (the system prompt, then the prompt), and scores a completion by recording it as
the assistant's reply in a trace and awaiting the task's own ``score``, as a verifiers rollout
does. The reward is the weighted mean of the task's rewards (their weighted sum over the sum
of the weights), so a reply that satisfies every reward function scores 1.

Two ways in: ``env = "verifiers:<taskset id>"`` loads an installed taskset package the way
verifiers does (``env_args`` fill its ``TasksetConfig``), and a factory of one's own can wrap
any taskset, in-memory ones included: ``VerifiersEnv(MyTaskset(MyConfig(...)), seed)``.

Only single-turn tasks fit: plexrl's rollout is one generation per prompt, with no turn for a
tool result or a simulated user to come back, so tasks with tool servers or a container are
refused when the environment is built, and rewards that need a runtime are skipped (verifiers
logs which). The taskset must be finite, or bounded with ``max_tasks``. Prompt ``i`` is task
``i mod n`` in an order shuffled by the seed afresh for each pass over the ``n`` tasks.

Needs the ``verifiers`` extra (``pip install 'plexrl[verifiers]'``).
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.envs.base import Environment, Message, Prompt


class VerifiersEnv(Environment):
    """A verifiers ``Taskset`` as a plexrl environment (see the module docstring)."""

    def __init__(
        self,
        taskset: Any,
        seed: int = 0,
        *,
        name: str | None = None,
        max_tasks: int | None = None,
    ) -> None:
        super().__init__(seed)
        if max_tasks is not None:
            taskset = taskset.take(max_tasks)
        elif not taskset.bounded:
            raise ValueError(
                f"taskset {type(taskset).__name__} never ends; set max_tasks to bound it"
            )
        self.tasks = list(taskset)
        if not self.tasks:
            raise ValueError(f"taskset {type(taskset).__name__} yields no tasks")
        for task in self.tasks:
            _check_single_turn(task)
        self.name = name or f"verifiers:{type(taskset).__name__}"
        self._messages = [_messages(task.data) for task in self.tasks]
        self._order: tuple[int, list[int]] = (-1, [])

    def prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        rounds, position = divmod(index, len(self.tasks))
        if self._order[0] != rounds:
            order = list(range(len(self.tasks)))
            random.Random(f"{self.name}:{self.seed}:{rounds}").shuffle(order)
            self._order = (rounds, order)
        task_index = self._order[1][position]
        target = getattr(self.tasks[task_index].data, "answer", "")
        return Prompt.chat(
            self._messages[task_index],
            target=target if isinstance(target, str) else str(target),
            info={"task": task_index},
        )

    def score(self, prompt: Prompt, completion_text: str) -> float:
        task = self.tasks[int(prompt.info["task"])]
        trace = _trace(task, self._messages[int(prompt.info["task"])], completion_text)
        _run(task.score(trace))
        rewards = [r for r in trace.rewards.values() if r is not None]
        total_weight = sum(r.weight for r in rewards)
        if not rewards or total_weight <= 0:
            return float(trace.reward)
        return float(trace.reward) / total_weight


def verifiers_env(taskset_id: str, seed: int = 0, **env_args: Any) -> VerifiersEnv:
    """The factory behind ``env = "verifiers:<taskset id>"``: the installed taskset, its config
    filled from ``env_args`` (``max_tasks`` bounds it)."""
    from verifiers.v1.utils.loaders import taskset_class, taskset_config_type

    max_tasks = env_args.pop("max_tasks", None)
    config = taskset_config_type(taskset_id)(id=taskset_id, **env_args)
    taskset = taskset_class(taskset_id)(config)
    return VerifiersEnv(taskset, seed, name=f"verifiers:{taskset_id}", max_tasks=max_tasks)


def _check_single_turn(task: Any) -> None:
    kind = type(task).__name__
    if task.NEEDS_CONTAINER or task.data.image is not None:
        raise ValueError(f"verifiers task {kind} needs a container; plexrl runs none")
    if type(task).toolsets(task.config):
        raise ValueError(
            f"verifiers task {kind} has tools; plexrl's rollouts are single-turn, with no "
            "turn for a tool's result"
        )
    if task.data.prompt is None:
        raise ValueError(f"verifiers task {kind} has no prompt; plexrl needs one to answer")


def _messages(data: Any) -> list[Message]:
    from verifiers.v1.types import content_text

    messages: list[Message] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
        return messages
    for message in data.prompt:
        if message.role not in ("system", "user", "assistant"):
            raise ValueError(f"a {message.role} message in a verifiers prompt needs tools")
        messages.append({"role": message.role, "content": content_text(message.content)})
    return messages


def _trace(task: Any, messages: list[Message], reply: str) -> Any:
    """The trace a verifiers rollout of ``task`` would leave had the model replied ``reply``."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    nodes = [
        MessageNode(parent=i - 1 if i else None, message=kinds[m["role"]](content=m["content"]))
        for i, m in enumerate(messages)
    ]
    nodes.append(
        MessageNode(parent=len(nodes) - 1, message=vf.AssistantMessage(content=reply), sampled=True)
    )
    return Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=AgentInfo(config=vf.AgentConfig(), name="plexrl", trainable=False),
        nodes=nodes,
    )


def _run(coroutine: Any) -> Any:
    """Await ``coroutine`` from synchronous code: here when no event loop runs in this thread
    (the orchestrator scores in a worker thread), else in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()

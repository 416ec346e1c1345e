"""The whole system as separate processes on one loopback nats-server, and faults injected into it.

:class:`System` starts a real ``nats-server`` (file store, ``sync_interval: always``, see
services/bus/server.py), then the registry, the trainer, one or two inference replicas and one
orchestrator per run, each as its own ``python -m services ...`` process with its own log under
``<root>/logs``. :meth:`System.run` drives the runs to the end while applying a schedule of
:class:`Fault` s: when a run reaches a step (trained, as the trainer's progress record says, or
generated, as the orchestrator's ``metrics.jsonl`` says; or, ``holding``, the moment after that
when an inference replica takes one of the run's generate requests), the target is killed with
SIGKILL and, after a pause, started again with the same arguments (the nats-server on the same
store and port). Checks of what the system recorded afterwards live in :mod:`.invariants`.

The orchestrators run with their default generate timeout (120 s): a request lost with a
process or the broker is sent again at once, and a scenario that waited it out would show it in
its recovery times.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nats.aio.msg import Msg

from schemas.codec import decode
from schemas.config import OrchConfig, dump_toml
from schemas.events import GenerateProgress, GenerateResponse
from schemas.records import Progress
from schemas.subjects import ROLLOUTS_STREAM
from services.bus import Bus, EmbeddedNats
from services.inference.requests import REPLICA_HEADER
from services.runs.progress import read_progress
from services.trainer.checkpoint import complete_checkpoints

from .cluster import NatsCluster
from .procs import Proc, clean_env
from .timing import LIVENESS_S, RECOVERIES, time_request, time_restart, time_service

MAX_LORA_RANK = 4


def run_config(max_steps: int, seed: int) -> OrchConfig:
    """A short reverse run: 2 prompts x 2 completions of at most 4 tokens, a checkpoint every 4."""
    return OrchConfig.model_validate(
        {
            "env": "reverse",
            "seed": seed,
            "max_steps": max_steps,
            "batch_size": 2,
            "group_size": 2,
            "max_async_level": 1,
            "model": {"lora": {"rank": MAX_LORA_RANK, "alpha": 8}},
            "optim": {"lr": 1e-2},
            "sampling": {"temperature": 1.0, "max_tokens": 4},
            "ckpt": {"interval": 4, "keep": 2},
            "eval": {"interval": 0},
        }
    )


Trigger = Literal["trained", "generated", "holding"]


@dataclass
class Fault:
    """SIGKILL ``target`` once ``run`` has ``at_step`` steps ``trigger`` (or, with ``after`` set,
    that many seconds after the previous fault), then start it again ``restart_after`` seconds
    later. Targets: ``trainer``, ``registry``, ``inference-<i>``, ``orchestrator-<run_id>``,
    ``nats`` (every server), ``nats-<i>`` (one node of a :class:`~.cluster.NatsCluster`).

    ``holding``: once ``run`` has ``at_step`` steps generated, the target dies the moment an
    inference replica (for an ``inference-<i>`` target, that one) says it took one of the run's
    generate requests: a request is in flight."""

    target: str
    run: str = ""
    at_step: int = 0
    trigger: Trigger = "trained"
    after: float | None = None
    restart_after: float = 0.5
    crash: str = ""
    """a ``PLEXRL_FAULT`` spec (services/launch/faults.py) the target starts with: it exits
    137 at that commit point on its own, and the restart goes without it"""
    killed_at: float | None = None
    restarted_at: float | None = None
    restarted_wall: float | None = None
    """``time.time()`` of the restart, to compare with the services' log lines"""
    killed_at_step: int | None = None
    signalled: bool = False
    """SIGKILL sent already (by a ``holding`` trigger, from the progress message)"""
    skipped: bool = False
    """the target (an orchestrator) had finished its run before the trigger came"""
    answered_first: bool = False
    """a ``holding`` kill of a replica that had sent its reply already (its progress message
    reached us late, under load): nothing was lost, so the scenario did not test a recovery"""

    def describe(self) -> str:
        if self.crash:
            return f"{self.target} exits at {self.crash}, restart {self.restart_after:.1f}s later"
        when = (
            f"{self.after:.1f}s after the previous fault"
            if self.after is not None
            else f"when a replica takes a request of {self.run} (from step {self.at_step})"
            if self.trigger == "holding"
            else f"when {self.run} has {self.at_step} steps {self.trigger}"
        )
        return f"SIGKILL {self.target} {when}, restart {self.restart_after:.1f}s later"


class System:
    """Every service of plexrl as its own process on a nats-server of its own, under ``root``."""

    def __init__(
        self,
        root: Path,
        model: Path,
        runs: dict[str, OrchConfig],
        *,
        replicas: int = 1,
        trainer_env: dict[str, str] | None = None,
        cluster: int = 0,
    ) -> None:
        self.root = root
        self.out = root / "out"
        self.logs = root / "logs"
        self.model = model
        self.runs = runs
        self.cluster = NatsCluster(root / "nats", cluster) if cluster else None
        """with ``cluster`` servers, a JetStream cluster whose streams have that many replicas"""
        self.nats: EmbeddedNats | NatsCluster = self.cluster or EmbeddedNats(
            store_dir=root / "nats"
        )
        self.env = {"PLEXRL_STREAM_REPLICAS": str(cluster)} if cluster else {}
        self.procs: dict[str, Proc] = {}
        self.replicas = replicas
        self.trainer_env = trainer_env or {}
        self.bus: Bus | None = None
        self.events: list[str] = []
        self.recoveries: dict[str, list[float]] = {k: [] for k in RECOVERIES}
        """seconds each fault took to recover from, by kind (see :data:`RECOVERIES`)"""
        self._armed: Fault | None = None
        self._inboxes: Any = None
        """while a ``holding`` fault is armed: a subscription to every client's inbox"""
        self._held: tuple[Fault, str, str] | None = None
        """a killed replica, and the request it held, until its restart: a reply it sent
        before the SIGKILL reached it shows that the kill came too late"""
        self._trained: dict[str, int] = {}
        """each run's steps trained, as last read (what the runs had when the server died)"""
        self._started = time.monotonic()
        self._timers: list[asyncio.Task[None]] = []
        self._timing: dict[str, asyncio.Task[None]] = {}
        self._at_nats_kill: dict[str, int] = {}
        self.resumed_from: dict[str, int] = {}
        """per run, the steps its newest checkpoint held when the trainer last restarted"""
        self._down: set[str] = set()

    # --- start and stop ---------------------------------------------------------------------

    def _proc(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        common = ["--nats-url", self.nats.url]
        env = clean_env() | self.env | (env or {})
        proc = Proc(name, [*argv, *common], self.logs / f"{name}.log", env)
        self.procs[name] = proc
        proc.start()
        return proc

    async def start(self) -> None:
        self.out.mkdir(parents=True)
        self.logs.mkdir(parents=True)
        self.nats.start()
        if self.cluster is not None:
            await self.cluster.wait_ready(len(self.cluster.nodes))
        sizes = ["--max-runs", str(len(self.runs)), "--max-lora-rank", str(MAX_LORA_RANK)]
        worker = ["--model", str(self.model), "--output-dir", str(self.out), "--threads", "1"]
        self._proc("registry", ["registry", "--output-dir", str(self.out), *sizes])
        self._proc(
            "trainer",
            ["trainer", *worker, *sizes, "--micro-batch-tokens", "64", "--collect-ms", "0"],
            self.trainer_env,
        )
        for i in range(self.replicas):
            argv = ["inference", *worker, *sizes, "--engine", "torch"]
            self._proc(f"inference-{i}", [*argv, "--replica-name", f"replica-{i}"])
        for run_id, config in self.runs.items():
            path = self.root / f"{run_id}.toml"
            path.write_text(dump_toml(config.to_dict()))
            argv = ["orchestrator", run_id, "--config", str(path), "--model", str(self.model)]
            self._proc(f"orchestrator-{run_id}", [*argv, "--output-dir", str(self.out)])
        self.bus = await Bus.connect(self.nats.url, "faults")

    async def stop(self) -> dict[str, int | None]:
        """Stop every process (services with SIGTERM, then the nats-server); their exit codes."""
        codes = {}
        for name in reversed(list(self.procs)):
            codes[name] = self.procs[name].stop()
        if self.bus is not None:
            await self.bus.close()
            self.bus = None
        self.nats.stop()
        return codes

    # --- what the system says about itself ------------------------------------------------

    async def progress(self, run_id: str) -> Progress | None:
        """The run's progress record, or None (none yet, or the nats-server is down)."""
        if self.bus is None or self.nats.proc is None:
            return None
        try:
            found = await asyncio.wait_for(read_progress(self.bus, run_id), 2.0)
        except Exception:
            return None
        if found is not None:
            self._trained[run_id] = found.step
        return found

    def generated(self, run_id: str) -> int:
        """Steps the run's orchestrators have finished (lines of its ``metrics.jsonl``)."""
        path = self.out / run_id / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    async def step_of(self, run_id: str, trigger: Trigger) -> int:
        if trigger in ("generated", "holding"):
            return self.generated(run_id)
        progress = await self.progress(run_id)
        return progress.step if progress is not None else 0

    def log(self, line: str) -> None:
        stamped = f"[{time.monotonic() - self._started:6.1f}s] {line}"
        self.events.append(stamped)
        print(stamped, flush=True)

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs.values())

    # --- faults -------------------------------------------------------------------------------

    async def _arm(self, fault: Fault) -> None:
        assert self.bus is not None
        self._armed = fault
        self._inboxes = await self.bus.nc.subscribe("_INBOX.>", cb=self._on_inbox)

    async def _disarm(self) -> None:
        sub, self._inboxes, self._armed = self._inboxes, None, None
        if sub is not None:
            await sub.unsubscribe()

    async def _on_inbox(self, msg: Msg) -> None:
        """A message to some client's inbox: a replica's GenerateProgress fires an armed
        ``holding`` fault at once (a generate request is in flight)."""
        self._answered_first(msg)
        fault = self._armed
        if fault is None:
            return
        try:
            progress = decode(msg.data, GenerateProgress)
        except Exception:  # a reply, or another inbox's message
            return
        target = fault.target
        if progress.run_id != fault.run or (
            target.startswith("inference-") and progress.replica != f"replica-{target[10:]}"
        ):
            return
        self._armed = None
        if target == "nats":
            self.nats.kill()
        else:
            popen = self.procs[target].popen
            assert popen is not None
            popen.send_signal(signal.SIGKILL)
        fault.signalled, fault.killed_at = True, time.monotonic()
        fault.killed_at_step = self.generated(fault.run)  # the step being generated
        self._down.add(target)
        self.log(f"{progress.replica} took {progress.request_id}: SIGKILL {target}")
        if target.startswith("inference-"):
            self._held = (fault, progress.replica, progress.request_id)

    def _answered_first(self, msg: Msg) -> None:
        if self._held is None or (msg.headers or {}).get(REPLICA_HEADER) != self._held[1]:
            return
        fault, replica, request_id = self._held
        try:
            reply = decode(msg.data, GenerateResponse, (msg.headers or {}).get("Content-Type"))
        except Exception:  # a progress message
            return
        if reply.request_id == request_id:
            fault.answered_first = True
            self.log(f"{replica} had answered {request_id} before the SIGKILL: nothing lost")

    async def _kill(self, fault: Fault) -> None:
        if fault.crash:
            proc = self.procs[fault.target]
            code = proc.exited()
            assert code == 137, f"{fault.target} exited with {code}, not at {fault.crash}"
            del proc.env["PLEXRL_FAULT"]
        elif fault.target == "nats":
            if fault.signalled:
                self._at_nats_kill = {r: self._trained.get(r, 0) for r in self.runs}
            else:
                self._at_nats_kill = {r: await self.step_of(r, "trained") for r in self.runs}
            self.nats.kill()
        elif self.cluster is not None and fault.target.startswith("nats-"):
            self._node(fault.target).kill()
        else:
            self.procs[fault.target].kill(fault.signalled)
        timer = self._timing.get(fault.target)
        if timer is not None and not timer.done():
            timer.cancel()
            self.log(f"{fault.target} killed again before a step was trained: restart not timed")
        if not fault.signalled:
            fault.killed_at = time.monotonic()
        self._down.add(fault.target)
        what = (
            f"{fault.target} exited at {fault.crash}" if fault.crash else f"killed {fault.target}"
        )
        at = fault.killed_at_step
        self.log(what + (f" at step {at}" if at is not None else ""))
        if fault.trigger == "holding" and fault.target.startswith("inference-"):
            assert at is not None and fault.killed_at is not None
            timer = asyncio.create_task(time_request(self, fault))
            self._timers.append(timer)

    async def _restart(self, fault: Fault) -> None:
        if fault.target == "nats":
            # the same store and port: what a supervisor restarting the server does
            self.nats.start()
        elif self.cluster is not None and fault.target.startswith("nats-"):
            self._node(fault.target).start()
        else:
            self.procs[fault.target].start()
        fault.restarted_at, fault.restarted_wall = time.monotonic(), time.time()
        self._down.discard(fault.target)
        self.log(f"restarted {fault.target}")
        if self._held is not None and self._held[0] is fault:
            self._held = None
            await self._disarm()
        if fault.target in ("trainer", "nats"):
            if fault.target == "trainer":
                trained = {r: _newest_checkpoint(self.out, r) for r in self.runs}
                self.resumed_from = trained
            else:
                trained = self._at_nats_kill
            timer = asyncio.create_task(time_restart(self, fault.target, time.time(), trained))
            self._timing[fault.target] = timer
            self._timers.append(timer)
        elif fault.target in self.procs:
            timer = asyncio.create_task(time_service(self, fault.target))
            self._timing[fault.target] = timer
            self._timers.append(timer)

    async def run(self, faults: list[Fault], timeout: float = LIVENESS_S) -> None:
        """Drive every run to the end, applying ``faults`` in order (each once its trigger is
        reached; a fault whose target is down waits for the restart of an earlier one)."""
        pending = list(faults)
        restarts: list[tuple[float, Fault]] = []
        last_fault = time.monotonic()
        last_change, last_seen = time.monotonic(), []
        for f in faults:
            self.log(f"scheduled: {f.describe()}")
        while True:
            now = time.monotonic()
            for due, fault in list(restarts):
                if now >= due:
                    restarts.remove((due, fault))
                    await self._restart(fault)
            target = self.procs.get(pending[0].target) if pending else None
            if target is not None and target.exited() == 0:
                pending[0].skipped = True
                self.log(f"skipped: {pending.pop(0).target} had finished its run")
                continue
            if pending and (
                pending[0].crash or pending[0].signalled or self._alive(pending[0].target)
            ):
                fault = pending[0]
                if fault.crash:
                    ready = self.procs[fault.target].exited() is not None
                elif fault.after is not None:
                    ready = now - last_fault >= fault.after
                elif fault.trigger == "holding":
                    if (
                        self._armed is None
                        and not fault.signalled
                        and await self.step_of(fault.run, "generated") >= fault.at_step
                    ):
                        await self._arm(fault)
                    ready = fault.signalled
                    if ready and self._held is None:
                        await self._disarm()
                else:
                    fault.killed_at_step = await self.step_of(fault.run, fault.trigger)
                    ready = fault.killed_at_step >= fault.at_step
                if ready:
                    pending.pop(0)
                    await self._kill(fault)
                    last_fault = time.monotonic()
                    restarts.append((last_fault + fault.restart_after, fault))
                    continue
            self._check_alive()
            done = [self.procs[f"orchestrator-{r}"].exited() == 0 for r in self.runs]
            if all(done) and not pending and not restarts:
                for timer in await asyncio.gather(*self._timers, return_exceptions=True):
                    if isinstance(timer, AssertionError):
                        raise timer
                # a service restarted near the end is stopped only once it serves: SIGTERM
                # during its imports ends it by the signal, not by a clean stop
                if all(p.ready() for p in self.procs.values()):
                    return
            seen = [self.generated(r) for r in self.runs]
            seen += [await self.step_of(r, "trained") for r in self.runs]
            if seen != last_seen:
                last_change, last_seen = now, seen
            if now - last_change > timeout:
                raise AssertionError(f"no progress for {timeout:.0f}s\n{self.tails()}")
            await asyncio.sleep(0.1)

    async def trainer_backlog(self, wait: float = 30.0) -> tuple[int, int]:
        """The trainer's consumer's (unacknowledged, undelivered) batches, once both are 0 or
        ``wait`` seconds have passed (the last acks follow the last WeightsReady)."""
        assert self.bus is not None
        deadline = time.monotonic() + wait
        while True:
            info = await self.bus.js.consumer_info(ROLLOUTS_STREAM, "trainer")
            backlog = (int(info.num_ack_pending or 0), int(info.num_pending or 0))
            if backlog == (0, 0) or time.monotonic() > deadline:
                return backlog
            await asyncio.sleep(0.2)

    def _alive(self, target: str) -> bool:
        if target == "nats":
            return self.nats.proc is not None
        if self.cluster is not None and target.startswith("nats-"):
            return self._node(target).proc is not None
        return self.procs[target].exited() is None

    def _node(self, target: str) -> EmbeddedNats:
        assert self.cluster is not None
        return self.cluster.nodes[int(target.removeprefix("nats-"))]

    def _check_alive(self) -> None:
        """A service that exits on its own (not killed here) fails the scenario; an
        orchestrator may exit 0, when its run is done."""
        for name, proc in self.procs.items():
            code = proc.exited()
            if code is None or name in self._down:
                continue
            if name.startswith("orchestrator-") and code == 0:
                continue
            raise AssertionError(f"{name} exited with {code} on its own\n{proc.tail(80)}")


def _newest_checkpoint(out: Path, run_id: str) -> int:
    found = complete_checkpoints(out, run_id)
    return found[-1][0] if found else 0


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

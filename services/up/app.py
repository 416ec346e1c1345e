"""``plexrl up``: an embedded NATS server, every service, and several demo runs learning at once.

Order of events: make sure the warm-started tiny model exists (built and cached on first use);
start NATS (unless one is named); start the registry, inference and trainer as child
processes (a child that crashes is started again, with backoff: services/up/supervisor.py);
drive one orchestrator per run (the demo runs, or a sweep's: services/up/sweep.py) in
this process (services/up/drive.py); show one live row per run;
when every run has trained all its steps (or on Ctrl-C), stop everything in reverse order and
write a summary, a ``reward.png`` per run and ``summary.json`` (and for a sweep its table and
plot, services/up/compare.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from rich.console import Console

from services.bus import Bus, EmbeddedNats, setup_tracing, stop_on_signals
from services.bus.tracing import shutdown_tracing
from services.telemetry.metrics import metrics_address, setup_metrics
from services.up.compare import report_sweep
from services.up.drive import drive_runs
from services.up.settings import UpSettings, default_cache_dir
from services.up.supervisor import ChildFailed, RestartPolicy, Supervisor
from services.up.sweep import SweepRun
from services.up.view import plot_rewards, summary_record, summary_table
from services.up.watchdog import Watchdog

log = logging.getLogger(__name__)

TINY_MODEL_VERSION = "v4"
MAX_LORA_RANK = 16


def ensure_tiny_model(console: Console, cache_dir: Path | None = None) -> Path:
    """The warm-started tiny model, built once into the cache and reused afterwards."""
    from services.model.pretrain import pretrain
    from services.model.tiny import build_tiny_model

    root = (cache_dir or default_cache_dir()) / "models"
    final = root / f"tiny-{TINY_MODEL_VERSION}-seed0"
    if (final / "pretrain.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = root / f".building-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    console.print(f"[bold]building the tiny model[/] (once; cached in {final}) ...")
    build_tiny_model(work, seed=0)
    started = time.monotonic()
    pretrain(work, seed=0, log=lambda line: console.print(f"  pretrain: {line}"))
    console.print(f"  warm start done in {time.monotonic() - started:.0f}s")
    with contextlib.suppress(FileExistsError, OSError):
        work.rename(final)  # another `plexrl up` may have won the race: use its copy
    shutil.rmtree(work, ignore_errors=True)
    return final


def unembed_targets(model_dir: Path) -> str:
    """The model family's LoRA targets and the unembedding (``lm_head``), comma-separated."""
    from services.model.families import default_target_modules

    config = json.loads((model_dir / "config.json").read_text())
    return ",".join([*default_target_modules(str(config.get("model_type", ""))), "lm_head"])


async def run_up(
    settings: UpSettings, planned: list[SweepRun], nats_url: str | None, console: Console
) -> int:
    output_dir = (
        settings.output_dir or Path("outputs") / time.strftime("up-%Y%m%d-%H%M%S")
    ).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = (settings.model or ensure_tiny_model(console)).resolve()
    max_runs = settings.slots
    console.print(f"output: {output_dir}\nmodel:  {model_dir}")
    if len(planned) > max_runs:
        console.print(f"{len(planned)} runs, {max_runs} at a time: the others wait for an index")

    server: EmbeddedNats | None = None
    if nats_url is None:
        server = EmbeddedNats(store_dir=output_dir / "nats")
        nats_url = server.start()
        console.print(f"nats:   {nats_url} (embedded, store {server.store_dir})")
    else:
        console.print(f"nats:   {nats_url}")

    sup = Supervisor(
        output_dir / "logs",
        RestartPolicy(max_restarts=settings.max_restarts, window_s=settings.restart_window_s),
        notify=lambda line: _notice(console, line),
    )
    bus: Bus | None = None
    watching: asyncio.Task[None] | None = None
    stop = stop_on_signals()
    ports = _child_metrics_ports()
    try:
        common = ["--nats-url", nats_url]
        rank = settings.gateway_max_lora_rank if settings.gateway else MAX_LORA_RANK
        sizes = ["--max-runs", str(max_runs), "--max-lora-rank", str(rank)]
        unembed = settings.gateway and settings.gateway_train_unembed and not settings.full_weights
        targets = ["--target-modules", unembed_targets(model_dir)] if unembed else []
        sup.start(
            "registry",
            ["registry", "--output-dir", str(output_dir), *sizes, *common],
            ports.get("registry"),
        )

        def start_worker(name: str, threads: int, *flags: str) -> None:
            argv = [name, "--model", str(model_dir), "--output-dir", str(output_dir)]
            argv += ["--threads", str(threads), "--weight-transport", settings.weight_transport]
            argv += ["--device", settings.device] if settings.device else []
            sup.start(name, [*argv, *flags, *sizes, *common], ports.get(name))

        start_worker("inference", settings.inference_threads, "--engine", "torch", *targets)
        full_weights = ["--full-weights"] if settings.full_weights else []
        transport_flags = _transport_flags(settings.weight_transport)
        start_worker("trainer", settings.trainer_threads, *transport_flags, *full_weights, *targets)
        if settings.gateway:
            port = str(settings.gateway_port)
            argv = ["gateway", "--model", str(model_dir), "--port", port, *common]
            argv += ["--model-name", settings.model_name] if settings.model_name else []
            sup.start("gateway", [*argv, "--train-unembed" if unembed else "--no-train-unembed"])
        bus = await Bus.connect(nats_url, "up")
        if settings.health_interval_s > 0:
            watchdog = Watchdog(
                bus,
                sup,
                interval_s=settings.health_interval_s,
                misses=settings.health_misses,
                timeout_s=min(10.0, settings.health_interval_s),
                notify=lambda line: _notice(console, line),
            )
            watching = asyncio.create_task(watchdog.run(stop))
        from services.model.loader import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        await _wait_for_inference(bus, sup, console)
        if not planned:
            return await _serve_gateway(settings, model_dir, sup, stop, console)
        name = settings.sweep_name
        driven = await drive_runs(
            bus,
            planned,
            output_dir=output_dir,
            tokenizer=tokenizer,
            stop=stop,
            console=console,
            live=settings.live and console.is_terminal,
            title=f"plexrl up: sweep {name}" if name else "plexrl up",
            submitted_by="plexrl up",
            check=sup.check,
            services=sup.status,
            early_stop=settings.sweep.early_stop if settings.sweep else None,
            release_finished=settings.sweep is not None,
        )
    except ChildFailed as exc:
        console.print(f"plexrl up stopped: {exc}", style="red", markup=False, highlight=False)
        return 1
    finally:
        stop.set()
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        sup.stop_all()
        if bus is not None:
            await bus.close()
        if server is not None:
            server.stop()

    for view in driven.views:
        view.refresh()
        plot_rewards(view)
    if name is not None:
        report_sweep(planned, driven, name, output_dir, console)
    else:
        wide = console
        if not console.is_terminal:  # a log or a pipe: wide enough that no column is cut
            wide = Console(file=console.file, width=max(console.width, 180))
        wide.print(summary_table(driven.views))
    summary = {
        r.run_id: {"status": r.status} | summary_record(v) | {"reason": r.reason}
        for r, v in zip(driven.results, driven.views, strict=True)
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    restarted = sup.status()
    if restarted is not None:
        _notice(console, restarted)
    console.print(f"metrics, plots and logs under {output_dir}")
    return driven.exit_code


def _notice(console: Console, line: str) -> None:
    """A line about the services, unwrapped (above the live table, or plain with --no-live)."""
    console.print(
        f"plexrl up: {line}", style="yellow", markup=False, highlight=False, soft_wrap=True
    )


async def _serve_gateway(
    settings: UpSettings, model_dir: Path, sup: Supervisor, stop: asyncio.Event, console: Console
) -> int:
    """No runs of its own: serve the gateway's clients until Ctrl-C (or a service fails)."""
    url = f"http://127.0.0.1:{settings.gateway_port}"
    console.print(
        f"gateway: {url} (Tinker: base_url={url!r}; OpenAI: {url}/v1); "
        f"base model {str(model_dir)!r}. Ctrl-C stops everything."
    )
    while not stop.is_set():
        sup.check()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return 0


def _child_metrics_ports() -> dict[str, dict[str, str]]:
    """With ``/metrics`` on port P here, the registry, inference and trainer serve P+1..P+3."""
    address = metrics_address()
    if address is None:
        return {}
    return {
        name: {"PLEXRL_METRICS_PORT": str(address[1] + i), "OTEL_EXPORTER_PROMETHEUS_PORT": ""}
        for i, name in enumerate(("registry", "inference", "trainer"), start=1)
    }


async def _wait_for_inference(
    bus: Bus, sup: Supervisor, console: Console, timeout: float = 300.0
) -> None:
    """Block until an inference replica answers (an error reply for an unknown run will do)."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from schemas import GenerateRequest, GenerateResponse
    from schemas.subjects import GENERATE

    probe = GenerateRequest(
        request_id="up-probe", run_id="run_up_probe", prompts=[[1]], max_tokens=1, timeout_s=1.0
    )
    deadline = time.monotonic() + timeout
    with console.status("waiting for services to start ..."):
        while time.monotonic() < deadline:
            sup.check()
            try:
                await bus.request(GENERATE, probe, GenerateResponse, timeout=2.0)
                return
            except (NoRespondersError, NatsTimeout):
                await asyncio.sleep(0.5)
    raise ChildFailed(
        f"no inference replica answered within {timeout:.0f}s; see {sup.log_dir}/inference.log"
    )


def main(settings: UpSettings, planned: list[SweepRun], nats_url: str | None) -> int:
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # The orchestrators run in this process: its spans and metrics are the orchestrator's.
    setup_tracing("orchestrator")
    setup_metrics("orchestrator")
    try:
        return asyncio.run(run_up(settings, planned, nats_url, Console()))
    finally:
        shutdown_tracing()


def _transport_flags(transport: str) -> list[str]:
    """A free rendezvous port for ``collective`` (replicas find it over NATS), so that two
    ``plexrl up`` on one machine do not meet at the default port; ucx already takes a free one."""
    if transport != "collective":
        return []
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return ["--collective-port", str(port)]

"""Graceful shutdown: SIGTERM and SIGINT set an ``asyncio.Event`` that every loop watches."""

from __future__ import annotations

import asyncio
import signal


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """Return an event set by SIGTERM or SIGINT (a second signal leaves the default handling)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()

    def _on_signal(sig: signal.Signals) -> None:
        stop.set()
        loop.remove_signal_handler(sig)  # a second Ctrl-C interrupts for real

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, _on_signal, sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    return stop

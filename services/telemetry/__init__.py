"""Metrics every service exposes for Prometheus to scrape (traces live in ``services.bus.tracing``)."""

from services.telemetry.metrics import metrics_address, setup_metrics

__all__ = ["metrics_address", "setup_metrics"]

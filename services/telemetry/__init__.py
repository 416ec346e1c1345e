"""Metrics every service exposes for Prometheus to scrape (traces live in ``services.bus.tracing``)."""

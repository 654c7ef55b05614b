"""Exceptions of the client: every error answer carries the service's problem details."""

from __future__ import annotations

from .models import Problem


class GpucastError(Exception):
    """Base of every error this package raises."""


class TransportError(GpucastError):
    """The service could not be reached, or its answer was not JSON."""


class ProblemError(GpucastError):
    """The service answered with an error status and problem details (RFC 7807)."""

    def __init__(self, problem: Problem, *, method: str = "", path: str = "") -> None:
        self.problem = problem
        self.method = method
        self.path = path
        super().__init__(f"{method} {path}: {problem.status} {problem.title}: {problem.detail}".strip())

    @property
    def status(self) -> int:
        return self.problem.status

    @property
    def title(self) -> str:
        return self.problem.title

    @property
    def detail(self) -> str:
        return self.problem.detail

    @property
    def type(self) -> str:
        return self.problem.type

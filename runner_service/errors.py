"""Errors the runner reports to its caller, each with the gRPC status it maps to."""

from __future__ import annotations

from collections.abc import Mapping

import grpc


class RunnerError(Exception):
    """An error with a gRPC status code and, for bad input, the offending fields."""

    def __init__(self, code: grpc.StatusCode, message: str, violations: Mapping[str, str] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = dict(violations or {})


def invalid_argument(violations: Mapping[str, str], message: str = "") -> RunnerError:
    text = message or "; ".join(f"{field}: {why}" for field, why in violations.items())
    return RunnerError(grpc.StatusCode.INVALID_ARGUMENT, text, violations)


def failed_precondition(message: str) -> RunnerError:
    return RunnerError(grpc.StatusCode.FAILED_PRECONDITION, message)


class ExecutionCancelled(Exception):
    """Raised from the step callback to stop denoising at a step boundary."""

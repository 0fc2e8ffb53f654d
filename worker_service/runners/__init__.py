"""The worker's runners: one ``RunnerClient`` (the runner's handle, the one owner of its state) per
runner, all owned by the ``RunnerPool``; the ``ExecutionGate`` between operations and executions."""

from worker_service.runners.client import ChannelSettings, RunnerClient
from worker_service.runners.pool import RunnerPool

__all__ = ["ChannelSettings", "RunnerClient", "RunnerPool"]

"""The worker's runners: one ``RunnerHandle`` (the runner's handle, the one owner of its state) per
runner, all owned by the ``RunnerPool``; the ``ExecutionGate`` between operations and executions."""

from worker_service.runners.handle import ChannelSettings, RunnerHandle
from worker_service.runners.pool import RunnerPool

__all__ = ["ChannelSettings", "RunnerHandle", "RunnerPool"]

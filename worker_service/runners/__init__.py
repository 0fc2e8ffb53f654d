"""The worker's runners: one ``RunnerClient`` per runner, all owned by the ``RunnerPool``."""

from worker_service.runners.client import ChannelSettings, RunnerClient
from worker_service.runners.pool import RunnerPool

__all__ = ["ChannelSettings", "RunnerClient", "RunnerPool"]

"""A runner group: one runner over several devices, one process per device (issue 27).

``launch`` starts the ranks and makes them live and die as one; ``GroupCommands`` runs each device
operation on every rank, all or nothing.
"""

from runner_service.group.commands import GroupCommands, GroupOperationError, Operation
from runner_service.group.launch import BROKEN_EXIT, RANK_DIED_EXIT, GroupMember, launch

__all__ = ["BROKEN_EXIT", "RANK_DIED_EXIT", "GroupCommands", "GroupMember", "GroupOperationError", "Operation",
           "launch"]

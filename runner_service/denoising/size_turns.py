"""``--step-schedule budget``: the size groups of a step batch take turns by their compute.

A step of a batch of mixed sizes runs one denoiser call per size group, and a small image's step
then lasts as long as every group's call: its latency is set by the large images beside it.
Here each group earns, at every step of the batch, the cost of the cheapest group's call, and
runs when its credit covers its own call's cost (rows x latent pixels): the cheapest group runs
at every step, one costing three times as much at every third. Each size group thus gets an equal
share of the device's compute while several are running (deficit round robin), the device is never
idle, and one size alone runs at every step as before. The runner reports the schedule in
``RunnerInfo.step_schedule``, and the worker then takes size classes in turns too
(``worker_service.scheduling.plan``). A sequence still advances at most one step per batch step, so progress stays per
step.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping


class SizeTurns:
    """The one owner of the size groups' credits."""

    def __init__(self) -> None:
        self._credits: dict[Hashable, float] = {}

    def due(self, costs: Mapping[Hashable, float]) -> list[Hashable]:
        """The groups that run this step, of those running (each with its call's cost); a group
        that is no longer running loses its credit."""
        if not costs:
            return []
        quantum = min(costs.values())
        self._credits = {group: self._credits.get(group, 0.0) + quantum for group in costs}
        due = [group for group, cost in costs.items() if self._credits[group] >= cost]
        for group in due:
            self._credits[group] -= costs[group]
        return due

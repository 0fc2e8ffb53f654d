"""How long a request will compute on the runner serving the model, from the costs the runner
measured (``ModelInfo.costs``, ``serving_common.cost``): a request that cannot finish before its
deadline is refused when it arrives, never sent to be abandoned; the dispatcher waits at least as
long as a step and a decode take before it calls a runner hung."""

from __future__ import annotations

from collections.abc import Sequence

from diffusion.v1 import common_pb2
from serving_common.cost import CostPoint, image_ms, request_seconds
from serving_common.errors import ServiceError, invalid_argument
from worker_service.validation import NormalizedRequest

# A request is refused only when its estimate exceeds the time left this many times over: the costs
# are measured on a device that may have been shared or throttled then (a CPU under other load, a GPU
# at another clock), and refusing a request that would have finished is worse than one cut short by
# its deadline, which stops at the next step. A request of ten minutes against a 90 s deadline is
# still refused at once.
ESTIMATE_MARGIN = 2.0


def _points(model: common_pb2.ModelInfo | None) -> list[CostPoint]:
    if model is None:
        return []
    return [CostPoint(point.pixels, point.step_ms, point.decode_ms) for point in model.costs]


def _pixels(request: NormalizedRequest) -> int:
    return request.width * request.height * max(request.num_frames, 1)


def too_long(request: NormalizedRequest, model: common_pb2.ModelInfo | None, time_left: float | None,
             field_prefix: str = "") -> ServiceError | None:
    """INVALID_ARGUMENT when ``request`` needs clearly more device time than the ``time_left`` before
    its deadline (``ESTIMATE_MARGIN``), naming ``num_inference_steps`` where fewer steps would fit, else
    ``width``; None when it may fit, has no deadline or nothing was measured."""
    points = _points(model)
    images = 1 if request.video else request.num_images
    needed = request_seconds(points, _pixels(request), request.num_inference_steps, images)
    if time_left is None or needed is None or needed <= ESTIMATE_MARGIN * time_left:
        return None
    one_step = request_seconds(points, _pixels(request), 1, images) or 0.0
    size = f"{request.width}x{request.height}" + (f"x{request.num_frames} frames" if request.video else "")
    kind = "video" if request.video else "image"
    why = (f"{size}, {request.num_inference_steps} steps, {images} {kind}(s) take about "
           f"{needed:.3g} s on this runner (by the costs it measured), more than {ESTIMATE_MARGIN:g} times the "
           f"{time_left:.3g} s left before the deadline: ask for fewer steps, a smaller size or a longer deadline")
    field = "num_inference_steps" if one_step <= ESTIMATE_MARGIN * time_left else "width"
    return invalid_argument({f"{field_prefix}{field}": why})


def pause_seconds(requests: Sequence[NormalizedRequest], model: common_pb2.ModelInfo | None) -> float:
    """The longest a runner may go between two progress events of a batch of ``requests`` by the
    costs it measured: one step and one decode of all its images (0: not measured)."""
    points = _points(model)
    total_ms = 0.0
    for request in requests:
        cost = image_ms(points, _pixels(request))
        if cost is not None:
            total_ms += (1 if request.video else request.num_images) * (cost[0] + cost[1])
    return total_ms / 1000

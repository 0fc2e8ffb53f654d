"""``diffusion status`` for a person: the worker's GetStatus in a few lines (state, model, sleep,
runners and their devices, queue, acceleration, parallel plan), where the full message (``--json``)
runs to hundreds of lines and shows the model once for the worker and again for each runner.

At most ``MAX_LINES`` lines whatever the number of runners: past ``MAX_RUNNERS`` they are counted.
"""

from __future__ import annotations

from collections.abc import Iterable

from clients.types import TASKS
from diffusion.v1 import common_pb2, worker_pb2
from serving_common.input_rules import describe_cache
from serving_common.protocol import DTYPE_NAMES

MAX_LINES = 30
MAX_RUNNERS = 8  # two lines each, beside the worker's dozen at most
_TASK_NAMES = {value: name for name, value in TASKS.items()}
_GIB = 1024**3


def _line(label: str, text: str) -> str:
    return f"{label:<14}{text}"


def _names(items: Iterable[str], none: str = "none") -> str:
    return ", ".join(items) or none


def _memory(memory: common_pb2.MemoryInfo) -> str:
    if not memory.total_bytes:
        return ""
    return f" {memory.used_bytes / _GIB:.1f}/{memory.total_bytes / _GIB:.1f} GiB"


def _model_lines(model: common_pb2.ModelInfo, weights_version: str) -> list[str]:
    dtype = DTYPE_NAMES.get(model.dtype, "default dtype")
    lines = [_line("model", f"{model.source} ({model.pipeline_class or 'unknown pipeline'}, {dtype}), "
                            f"weights {weights_version or '-'}")]
    sizes = f"{model.min_size or model.size_multiple or 1} to {model.max_size or 'any'}, multiples of " \
            f"{model.size_multiple or 1}"
    if model.HasField("capabilities"):
        capabilities = model.capabilities
        steps = f"; at most {capabilities.max_steps} steps" if capabilities.max_steps else ""
        lines.append(_line("sizes", sizes + steps))
        lines.append(_line("tasks", _names(_TASK_NAMES.get(task, str(task)) for task in capabilities.tasks)))
        if capabilities.HasField("video"):
            video = capabilities.video
            grid = f"{video.frame_step}k+1 " if video.frame_step > 1 else ""
            lines.append(_line("video", f"{grid}frames in [{video.min_frames}, {video.max_frames}] (default "
                                        f"{video.default_frames}), {video.min_fps} to {video.max_fps} fps "
                                        f"(default {video.default_fps})"))
    else:
        lines.append(_line("sizes", sizes))
    return lines


def _sleep(status: worker_pb2.GetStatusResponse) -> str:
    if status.sleep_level:
        asleep = f"level {status.sleep_level} ({_names(status.sleeping_components, 'all components')})"
        asleep += ", by the idle timer" if status.last_sleep_idle else ""
    else:
        asleep = "awake"
    idle = f"sleeps after {status.idle_sleep_after_s:g} s idle" if status.idle_sleep_after_s else "no idle sleep"
    return f"{asleep}; {idle}"


def _acceleration(model: common_pb2.ModelInfo) -> str:
    applied = model.acceleration
    parts = []
    if applied.cache:
        parts.append(describe_cache(applied))
    if applied.compile:
        parts.append("compiled")
    if applied.quantization:
        parts.append(applied.quantization)
    if applied.attention_backend:
        parts.append(f"attention {applied.attention_backend}")
    offer = model.acceleration_offer
    offered = [*offer.cache_methods, *(["compile"] if offer.compile else []), *offer.quantizations]
    return f"{_names(parts)} (offered: {_names(offered)})"


def _parallel(model: common_pb2.ModelInfo) -> str:
    plan = model.parallel
    parts = [*(["cfg"] if plan.cfg else []),
             *([f"ulysses {plan.ulysses_degree}"] if plan.ulysses_degree > 1 else []),
             *([f"ring {plan.ring_degree}"] if plan.ring_degree > 1 else [])]
    return _names(parts, "none: each request on one device")


def _runner_lines(runner: worker_pb2.RunnerStatus) -> list[str]:
    state = "unreachable" if not runner.connected else "ready" if runner.ready else "not ready"
    head = f"  {runner.target}  {state}"
    if not runner.HasField("info"):
        return [f"{head}, restarts {runner.restarts}"]
    info = runner.info
    lines = [f"{head}, {info.platform or 'unknown platform'}, {runner.requests_in_flight} in flight, "
             f"restarts {runner.restarts}"]
    devices = [f"{device.rank}: {device.device_name}{_memory(device.memory)}" for device in info.devices] or \
              [f"{info.device_name}{_memory(info.memory)}"]
    lines.append(f"    devices {'; '.join(devices)}")
    return lines


def status_summary(status: worker_pb2.GetStatusResponse) -> str:
    """The lines of ``diffusion status`` (at most ``MAX_LINES``)."""
    state = worker_pb2.WorkerState.Name(status.state).removeprefix("WORKER_STATE_").lower()
    lines = [_line("state", f"{state}: {status.message}" if status.message else state)]
    has_model = status.HasField("model") and bool(status.model.source)
    lines += _model_lines(status.model, status.weights_version) if has_model else [_line("model", "none loaded")]
    lines.append(_line("sleep", _sleep(status)))
    ready = sum(runner.ready for runner in status.runners)
    lines.append(_line("runners", f"{ready} of {len(status.runners)} ready"))
    for runner in status.runners[:MAX_RUNNERS]:
        lines += _runner_lines(runner)
    if len(status.runners) > MAX_RUNNERS:
        lines.append(f"  and {len(status.runners) - MAX_RUNNERS} more (diffusion status --json)")
    lines.append(_line("queue", f"{status.queue_depth} queued, {status.requests_in_flight} in flight "
                                "(diffusion requests)"))
    if has_model:
        lines.append(_line("acceleration", _acceleration(status.model)))
        lines.append(_line("parallel", _parallel(status.model)))
    return "\n".join(lines)

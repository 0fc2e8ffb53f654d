from diffusion.v1 import common_pb2 as _common_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_FORMAT_UNSPECIFIED: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_PNG: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_JPEG: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_WEBP: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_RAW: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_MP4: _ClassVar[OutputFormat]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_LOADING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_SLEEPING: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]

class ResizeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIZE_MODE_UNSPECIFIED: _ClassVar[ResizeMode]
    RESIZE_MODE_RESIZE: _ClassVar[ResizeMode]
    RESIZE_MODE_CROP: _ClassVar[ResizeMode]
OUTPUT_FORMAT_UNSPECIFIED: OutputFormat
OUTPUT_FORMAT_PNG: OutputFormat
OUTPUT_FORMAT_JPEG: OutputFormat
OUTPUT_FORMAT_WEBP: OutputFormat
OUTPUT_FORMAT_RAW: OutputFormat
OUTPUT_FORMAT_MP4: OutputFormat
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_LOADING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_SLEEPING: WorkerState
WORKER_STATE_FAILED: WorkerState
WORKER_STATE_DRAINING: WorkerState
RESIZE_MODE_UNSPECIFIED: ResizeMode
RESIZE_MODE_RESIZE: ResizeMode
RESIZE_MODE_CROP: ResizeMode

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "negative_prompt", "width", "height", "num_inference_steps", "guidance_scale", "seed", "num_images", "output_format", "adapters", "image", "mask_image", "strength", "task", "resize_mode", "true_cfg_scale", "cache_threshold", "num_frames", "fps", "return_frames", "partial_images", "sampler", "controls", "ip_adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    MASK_IMAGE_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    RESIZE_MODE_FIELD_NUMBER: _ClassVar[int]
    TRUE_CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    CACHE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    CONTROLS_FIELD_NUMBER: _ClassVar[int]
    IP_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    num_images: int
    output_format: OutputFormat
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterRef]
    image: bytes
    mask_image: bytes
    strength: float
    task: _common_pb2.Task
    resize_mode: ResizeMode
    true_cfg_scale: float
    cache_threshold: float
    num_frames: int
    fps: int
    return_frames: bool
    partial_images: int
    sampler: str
    controls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ControlInput]
    ip_adapter: _common_pb2.ImagePrompt
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., num_images: _Optional[int] = ..., output_format: _Optional[_Union[OutputFormat, str]] = ..., adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterRef, _Mapping]]] = ..., image: _Optional[bytes] = ..., mask_image: _Optional[bytes] = ..., strength: _Optional[float] = ..., task: _Optional[_Union[_common_pb2.Task, str]] = ..., resize_mode: _Optional[_Union[ResizeMode, str]] = ..., true_cfg_scale: _Optional[float] = ..., cache_threshold: _Optional[float] = ..., num_frames: _Optional[int] = ..., fps: _Optional[int] = ..., return_frames: _Optional[bool] = ..., partial_images: _Optional[int] = ..., sampler: _Optional[str] = ..., controls: _Optional[_Iterable[_Union[_common_pb2.ControlInput, _Mapping]]] = ..., ip_adapter: _Optional[_Union[_common_pb2.ImagePrompt, _Mapping]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "mime_type", "width", "height", "seed", "parameters")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    width: int
    height: int
    seed: int
    parameters: _struct_pb2.Struct
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., seed: _Optional[int] = ..., parameters: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("data", "mime_type", "width", "height", "num_frames", "fps", "seed", "frames")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int
    frames: bytes
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_frames: _Optional[int] = ..., fps: _Optional[int] = ..., seed: _Optional[int] = ..., frames: _Optional[bytes] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "execute_ms", "encode_ms", "total_ms", "runner", "transfer_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    execute_ms: float
    encode_ms: float
    total_ms: float
    runner: _common_pb2.RunnerTimings
    transfer_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., execute_ms: _Optional[float] = ..., encode_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., runner: _Optional[_Union[_common_pb2.RunnerTimings, _Mapping]] = ..., transfer_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "images", "weights_version", "timings", "model", "videos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    weights_version: str
    timings: Timings
    model: str
    videos: _containers.RepeatedCompositeFieldContainer[Video]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., weights_version: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., model: _Optional[str] = ..., videos: _Optional[_Iterable[_Union[Video, _Mapping]]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class QueuedEvent(_message.Message):
    __slots__ = ("request_id", "position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    position: int
    def __init__(self, request_id: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class StartedEvent(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ProgressEvent(_message.Message):
    __slots__ = ("step", "total_steps", "phase", "previews", "partial_image_index")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PREVIEWS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    phase: _common_pb2.ProgressPhase
    previews: _containers.RepeatedCompositeFieldContainer[Image]
    partial_image_index: int
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., phase: _Optional[_Union[_common_pb2.ProgressPhase, str]] = ..., previews: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., partial_image_index: _Optional[int] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("video_index", "frames", "offset", "data", "total_bytes")
    VIDEO_INDEX_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    video_index: int
    frames: bool
    offset: int
    data: bytes
    total_bytes: int
    def __init__(self, video_index: _Optional[int] = ..., frames: _Optional[bool] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("queued", "started", "progress", "done", "chunk")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    queued: QueuedEvent
    started: StartedEvent
    progress: ProgressEvent
    done: GenerateResponse
    chunk: ResultChunk
    def __init__(self, queued: _Optional[_Union[QueuedEvent, _Mapping]] = ..., started: _Optional[_Union[StartedEvent, _Mapping]] = ..., progress: _Optional[_Union[ProgressEvent, _Mapping]] = ..., done: _Optional[_Union[GenerateResponse, _Mapping]] = ..., chunk: _Optional[_Union[ResultChunk, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("was",)
    WAS_FIELD_NUMBER: _ClassVar[int]
    was: str
    def __init__(self, was: _Optional[str] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("model", "dtype", "acceleration", "parallel", "component_overrides", "fused_adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    FUSED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: _common_pb2.Dtype
    acceleration: _common_pb2.Acceleration
    parallel: _common_pb2.Parallelism
    component_overrides: _containers.RepeatedCompositeFieldContainer[_common_pb2.ComponentOverride]
    fused_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.FusedAdapter]
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.Dtype, str]] = ..., acceleration: _Optional[_Union[_common_pb2.Acceleration, _Mapping]] = ..., parallel: _Optional[_Union[_common_pb2.Parallelism, _Mapping]] = ..., component_overrides: _Optional[_Iterable[_Union[_common_pb2.ComponentOverride, _Mapping]]] = ..., fused_adapters: _Optional[_Iterable[_Union[_common_pb2.FusedAdapter, _Mapping]]] = ...) -> None: ...

class InitResponse(_message.Message):
    __slots__ = ("model", "weights_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    weights_version: str
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., weights_version: _Optional[str] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level", "tags")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    level: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, level: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("freed_bytes", "weight_bytes_released", "sleeping_components")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    weight_bytes_released: int
    sleeping_components: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, freed_bytes: _Optional[int] = ..., weight_bytes_released: _Optional[int] = ..., sleeping_components: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("weight_bytes_restored", "sleeping_components")
    WEIGHT_BYTES_RESTORED_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    weight_bytes_restored: int
    sleeping_components: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, weight_bytes_restored: _Optional[int] = ..., sleeping_components: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("loaded_names", "weights_version")
    LOADED_NAMES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    loaded_names: _containers.RepeatedScalarFieldContainer[str]
    weights_version: str
    def __init__(self, loaded_names: _Optional[_Iterable[str]] = ..., weights_version: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunnerStatus(_message.Message):
    __slots__ = ("target", "connected", "info", "restarts", "ready", "requests_in_flight")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    target: str
    connected: bool
    info: _common_pb2.RunnerInfo
    restarts: int
    ready: bool
    requests_in_flight: int
    def __init__(self, target: _Optional[str] = ..., connected: _Optional[bool] = ..., info: _Optional[_Union[_common_pb2.RunnerInfo, _Mapping]] = ..., restarts: _Optional[int] = ..., ready: _Optional[bool] = ..., requests_in_flight: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("state", "message", "model", "sleep_level", "sleeping_components", "runners", "queue_depth", "requests_in_flight", "weights_version", "statistics", "idle_sleep_after_s", "last_sleep_idle", "active_requests", "adapters", "weights_checksum", "served_model_names", "defaults")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    RUNNERS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SLEEP_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_SLEEP_IDLE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    message: str
    model: _common_pb2.ModelInfo
    sleep_level: int
    sleeping_components: _containers.RepeatedScalarFieldContainer[str]
    runners: _containers.RepeatedCompositeFieldContainer[RunnerStatus]
    queue_depth: int
    requests_in_flight: int
    weights_version: str
    statistics: WorkerStatistics
    idle_sleep_after_s: float
    last_sleep_idle: bool
    active_requests: _containers.RepeatedCompositeFieldContainer[ActiveRequest]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterInfo]
    weights_checksum: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    defaults: _common_pb2.GenerationDefaults
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., message: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., sleep_level: _Optional[int] = ..., sleeping_components: _Optional[_Iterable[str]] = ..., runners: _Optional[_Iterable[_Union[RunnerStatus, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., weights_version: _Optional[str] = ..., statistics: _Optional[_Union[WorkerStatistics, _Mapping]] = ..., idle_sleep_after_s: _Optional[float] = ..., last_sleep_idle: _Optional[bool] = ..., active_requests: _Optional[_Iterable[_Union[ActiveRequest, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterInfo, _Mapping]]] = ..., weights_checksum: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., defaults: _Optional[_Union[_common_pb2.GenerationDefaults, _Mapping]] = ...) -> None: ...

class ActiveRequest(_message.Message):
    __slots__ = ("request_id", "state", "position", "step", "total_steps", "age_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: str
    position: int
    step: int
    total_steps: int
    age_ms: float
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[str] = ..., position: _Optional[int] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., age_ms: _Optional[float] = ...) -> None: ...

class RequestCount(_message.Message):
    __slots__ = ("method", "code", "count")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    method: str
    code: str
    count: int
    def __init__(self, method: _Optional[str] = ..., code: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class WorkerStatistics(_message.Message):
    __slots__ = ("requests", "images_generated", "generations", "queue_ms_total", "queue_ms_mean", "execute_ms_total", "execute_ms_mean", "denoising_steps", "idle_sleeps")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_GENERATED_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_MEAN_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_MS_MEAN_FIELD_NUMBER: _ClassVar[int]
    DENOISING_STEPS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SLEEPS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestCount]
    images_generated: int
    generations: int
    queue_ms_total: float
    queue_ms_mean: float
    execute_ms_total: float
    execute_ms_mean: float
    denoising_steps: int
    idle_sleeps: int
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestCount, _Mapping]]] = ..., images_generated: _Optional[int] = ..., generations: _Optional[int] = ..., queue_ms_total: _Optional[float] = ..., queue_ms_mean: _Optional[float] = ..., execute_ms_total: _Optional[float] = ..., execute_ms_mean: _Optional[float] = ..., denoising_steps: _Optional[int] = ..., idle_sleeps: _Optional[int] = ...) -> None: ...

class AttachRunnerRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: str
    def __init__(self, target: _Optional[str] = ...) -> None: ...

class AttachRunnerResponse(_message.Message):
    __slots__ = ("runner",)
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    runner: RunnerStatus
    def __init__(self, runner: _Optional[_Union[RunnerStatus, _Mapping]] = ...) -> None: ...

class DetachRunnerRequest(_message.Message):
    __slots__ = ("target", "drain")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    target: str
    drain: bool
    def __init__(self, target: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class DetachRunnerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "pin", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    pin: bool
    kind: _common_pb2.AdapterKind
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., pin: _Optional[bool] = ..., kind: _Optional[_Union[_common_pb2.AdapterKind, str]] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterInfo
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "max_adapters")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterInfo]
    max_adapters: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterInfo, _Mapping]]] = ..., max_adapters: _Optional[int] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("chunk", "commit", "chunks")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TensorChunk
    commit: _common_pb2.PushWeightsCommit
    chunks: _common_pb2.TensorChunks
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., commit: _Optional[_Union[_common_pb2.PushWeightsCommit, _Mapping]] = ..., chunks: _Optional[_Union[_common_pb2.TensorChunks, _Mapping]] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("loaded_names", "weights_version", "checksum", "bytes_received")
    LOADED_NAMES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    loaded_names: _containers.RepeatedScalarFieldContainer[str]
    weights_version: str
    checksum: str
    bytes_received: int
    def __init__(self, loaded_names: _Optional[_Iterable[str]] = ..., weights_version: _Optional[str] = ..., checksum: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class GetWeightsChecksumRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWeightsChecksumResponse(_message.Message):
    __slots__ = ("checksum", "weights_version")
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    checksum: str
    weights_version: str
    def __init__(self, checksum: _Optional[str] = ..., weights_version: _Optional[str] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]

class Task(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_UNSPECIFIED: _ClassVar[Task]
    TASK_TEXT_TO_IMAGE: _ClassVar[Task]
    TASK_IMAGE_TO_IMAGE: _ClassVar[Task]
    TASK_INPAINT: _ClassVar[Task]
    TASK_EDIT: _ClassVar[Task]
    TASK_TEXT_TO_VIDEO: _ClassVar[Task]
    TASK_IMAGE_TO_VIDEO: _ClassVar[Task]

class ProgressPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROGRESS_PHASE_UNSPECIFIED: _ClassVar[ProgressPhase]
    PROGRESS_PHASE_DENOISING: _ClassVar[ProgressPhase]
    PROGRESS_PHASE_DECODING: _ClassVar[ProgressPhase]
    PROGRESS_PHASE_ENCODING: _ClassVar[ProgressPhase]

class GuidanceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GUIDANCE_KIND_UNSPECIFIED: _ClassVar[GuidanceKind]
    GUIDANCE_KIND_NONE: _ClassVar[GuidanceKind]
    GUIDANCE_KIND_CLASSIFIER_FREE: _ClassVar[GuidanceKind]
    GUIDANCE_KIND_DISTILLED: _ClassVar[GuidanceKind]
    GUIDANCE_KIND_TRUE_CFG: _ClassVar[GuidanceKind]
    GUIDANCE_KIND_PRIOR: _ClassVar[GuidanceKind]

class AdapterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_KIND_UNSPECIFIED: _ClassVar[AdapterKind]
    ADAPTER_KIND_LORA: _ClassVar[AdapterKind]
    ADAPTER_KIND_CONTROLNET: _ClassVar[AdapterKind]
    ADAPTER_KIND_IP_ADAPTER: _ClassVar[AdapterKind]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
TASK_UNSPECIFIED: Task
TASK_TEXT_TO_IMAGE: Task
TASK_IMAGE_TO_IMAGE: Task
TASK_INPAINT: Task
TASK_EDIT: Task
TASK_TEXT_TO_VIDEO: Task
TASK_IMAGE_TO_VIDEO: Task
PROGRESS_PHASE_UNSPECIFIED: ProgressPhase
PROGRESS_PHASE_DENOISING: ProgressPhase
PROGRESS_PHASE_DECODING: ProgressPhase
PROGRESS_PHASE_ENCODING: ProgressPhase
GUIDANCE_KIND_UNSPECIFIED: GuidanceKind
GUIDANCE_KIND_NONE: GuidanceKind
GUIDANCE_KIND_CLASSIFIER_FREE: GuidanceKind
GUIDANCE_KIND_DISTILLED: GuidanceKind
GUIDANCE_KIND_TRUE_CFG: GuidanceKind
GUIDANCE_KIND_PRIOR: GuidanceKind
ADAPTER_KIND_UNSPECIFIED: AdapterKind
ADAPTER_KIND_LORA: AdapterKind
ADAPTER_KIND_CONTROLNET: AdapterKind
ADAPTER_KIND_IP_ADAPTER: AdapterKind

class ComponentInfo(_message.Message):
    __slots__ = ("name", "class_name", "parameter_count", "bytes", "asleep")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLASS_NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ASLEEP_FIELD_NUMBER: _ClassVar[int]
    name: str
    class_name: str
    parameter_count: int
    bytes: int
    asleep: bool
    def __init__(self, name: _Optional[str] = ..., class_name: _Optional[str] = ..., parameter_count: _Optional[int] = ..., bytes: _Optional[int] = ..., asleep: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("source", "pipeline_class", "dtype", "components", "sleep_level", "min_size", "size_multiple", "max_size", "capabilities", "acceleration", "acceleration_offer", "parallel", "costs", "scheduler", "revision", "component_overrides", "fused_adapters", "defaults")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_CLASS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATION_FIELD_NUMBER: _ClassVar[int]
    ACCELERATION_OFFER_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    FUSED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    source: str
    pipeline_class: str
    dtype: Dtype
    components: _containers.RepeatedCompositeFieldContainer[ComponentInfo]
    sleep_level: int
    min_size: int
    size_multiple: int
    max_size: int
    capabilities: ModelCapabilities
    acceleration: Acceleration
    acceleration_offer: AccelerationOffer
    parallel: Parallelism
    costs: _containers.RepeatedCompositeFieldContainer[CostPoint]
    scheduler: str
    revision: str
    component_overrides: _containers.RepeatedCompositeFieldContainer[ComponentOverride]
    fused_adapters: _containers.RepeatedCompositeFieldContainer[FusedAdapter]
    defaults: GenerationDefaults
    def __init__(self, source: _Optional[str] = ..., pipeline_class: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., components: _Optional[_Iterable[_Union[ComponentInfo, _Mapping]]] = ..., sleep_level: _Optional[int] = ..., min_size: _Optional[int] = ..., size_multiple: _Optional[int] = ..., max_size: _Optional[int] = ..., capabilities: _Optional[_Union[ModelCapabilities, _Mapping]] = ..., acceleration: _Optional[_Union[Acceleration, _Mapping]] = ..., acceleration_offer: _Optional[_Union[AccelerationOffer, _Mapping]] = ..., parallel: _Optional[_Union[Parallelism, _Mapping]] = ..., costs: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., scheduler: _Optional[str] = ..., revision: _Optional[str] = ..., component_overrides: _Optional[_Iterable[_Union[ComponentOverride, _Mapping]]] = ..., fused_adapters: _Optional[_Iterable[_Union[FusedAdapter, _Mapping]]] = ..., defaults: _Optional[_Union[GenerationDefaults, _Mapping]] = ...) -> None: ...

class ComponentOverride(_message.Message):
    __slots__ = ("name", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class FusedAdapter(_message.Message):
    __slots__ = ("source", "scale")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    source: str
    scale: float
    def __init__(self, source: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class GenerationDefaults(_message.Message):
    __slots__ = ("num_inference_steps", "guidance_scale", "width", "height")
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    num_inference_steps: int
    guidance_scale: float
    width: int
    height: int
    def __init__(self, num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class CostPoint(_message.Message):
    __slots__ = ("pixels", "step_ms", "decode_ms")
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    pixels: int
    step_ms: float
    decode_ms: float
    def __init__(self, pixels: _Optional[int] = ..., step_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ...) -> None: ...

class Parallelism(_message.Message):
    __slots__ = ("cfg", "ulysses_degree", "ring_degree")
    CFG_FIELD_NUMBER: _ClassVar[int]
    ULYSSES_DEGREE_FIELD_NUMBER: _ClassVar[int]
    RING_DEGREE_FIELD_NUMBER: _ClassVar[int]
    cfg: bool
    ulysses_degree: int
    ring_degree: int
    def __init__(self, cfg: _Optional[bool] = ..., ulysses_degree: _Optional[int] = ..., ring_degree: _Optional[int] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("rank", "device_name", "memory")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    device_name: str
    memory: MemoryInfo
    def __init__(self, rank: _Optional[int] = ..., device_name: _Optional[str] = ..., memory: _Optional[_Union[MemoryInfo, _Mapping]] = ...) -> None: ...

class Acceleration(_message.Message):
    __slots__ = ("cache", "cache_threshold", "cache_warmup_steps", "compile", "quantization", "attention_backend")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CACHE_WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    cache: str
    cache_threshold: float
    cache_warmup_steps: int
    compile: bool
    quantization: str
    attention_backend: str
    def __init__(self, cache: _Optional[str] = ..., cache_threshold: _Optional[float] = ..., cache_warmup_steps: _Optional[int] = ..., compile: _Optional[bool] = ..., quantization: _Optional[str] = ..., attention_backend: _Optional[str] = ...) -> None: ...

class AccelerationOffer(_message.Message):
    __slots__ = ("cache_methods", "quantizations", "attention_backends", "compile")
    CACHE_METHODS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATIONS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    cache_methods: _containers.RepeatedScalarFieldContainer[str]
    quantizations: _containers.RepeatedScalarFieldContainer[str]
    attention_backends: _containers.RepeatedScalarFieldContainer[str]
    compile: bool
    def __init__(self, cache_methods: _Optional[_Iterable[str]] = ..., quantizations: _Optional[_Iterable[str]] = ..., attention_backends: _Optional[_Iterable[str]] = ..., compile: _Optional[bool] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("rows", "skipped_rows")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    skipped_rows: int
    def __init__(self, rows: _Optional[int] = ..., skipped_rows: _Optional[int] = ...) -> None: ...

class VideoCapabilities(_message.Message):
    __slots__ = ("frame_step", "min_frames", "max_frames", "default_frames", "min_fps", "max_fps", "default_fps")
    FRAME_STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FPS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FPS_FIELD_NUMBER: _ClassVar[int]
    frame_step: int
    min_frames: int
    max_frames: int
    default_frames: int
    min_fps: int
    max_fps: int
    default_fps: int
    def __init__(self, frame_step: _Optional[int] = ..., min_frames: _Optional[int] = ..., max_frames: _Optional[int] = ..., default_frames: _Optional[int] = ..., min_fps: _Optional[int] = ..., max_fps: _Optional[int] = ..., default_fps: _Optional[int] = ...) -> None: ...

class ModelCapabilities(_message.Message):
    __slots__ = ("negative_prompt", "guidance", "default_guidance_scale", "step_events", "step_callback", "stages", "tasks", "step_batching", "true_cfg", "default_true_cfg_scale", "step_batching_tasks", "video", "max_steps", "samplers", "adapter_kinds")
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    STEP_EVENTS_FIELD_NUMBER: _ClassVar[int]
    STEP_CALLBACK_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    STEP_BATCHING_FIELD_NUMBER: _ClassVar[int]
    TRUE_CFG_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TRUE_CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    STEP_BATCHING_TASKS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_KINDS_FIELD_NUMBER: _ClassVar[int]
    negative_prompt: bool
    guidance: GuidanceKind
    default_guidance_scale: float
    step_events: bool
    step_callback: str
    stages: int
    tasks: _containers.RepeatedScalarFieldContainer[Task]
    step_batching: bool
    true_cfg: bool
    default_true_cfg_scale: float
    step_batching_tasks: _containers.RepeatedScalarFieldContainer[Task]
    video: VideoCapabilities
    max_steps: int
    samplers: _containers.RepeatedScalarFieldContainer[str]
    adapter_kinds: _containers.RepeatedScalarFieldContainer[AdapterKind]
    def __init__(self, negative_prompt: _Optional[bool] = ..., guidance: _Optional[_Union[GuidanceKind, str]] = ..., default_guidance_scale: _Optional[float] = ..., step_events: _Optional[bool] = ..., step_callback: _Optional[str] = ..., stages: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[Task, str]]] = ..., step_batching: _Optional[bool] = ..., true_cfg: _Optional[bool] = ..., default_true_cfg_scale: _Optional[float] = ..., step_batching_tasks: _Optional[_Iterable[_Union[Task, str]]] = ..., video: _Optional[_Union[VideoCapabilities, _Mapping]] = ..., max_steps: _Optional[int] = ..., samplers: _Optional[_Iterable[str]] = ..., adapter_kinds: _Optional[_Iterable[_Union[AdapterKind, str]]] = ...) -> None: ...

class PromptCacheStats(_message.Message):
    __slots__ = ("hits", "misses", "entries", "bytes", "max_bytes")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class MemoryInfo(_message.Message):
    __slots__ = ("used_bytes", "total_bytes")
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    used_bytes: int
    total_bytes: int
    def __init__(self, used_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class RunnerInfo(_message.Message):
    __slots__ = ("instance_id", "platform", "device_name", "memory", "model", "weights_version", "weight_updates", "adapters", "max_adapters", "weights_checksum", "prompt_cache", "cache", "devices", "step_schedule", "device_busy_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STEP_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    platform: str
    device_name: str
    memory: MemoryInfo
    model: ModelInfo
    weights_version: str
    weight_updates: _containers.RepeatedCompositeFieldContainer[WeightUpdate]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_adapters: int
    weights_checksum: str
    prompt_cache: PromptCacheStats
    cache: CacheStats
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    step_schedule: str
    device_busy_s: float
    def __init__(self, instance_id: _Optional[str] = ..., platform: _Optional[str] = ..., device_name: _Optional[str] = ..., memory: _Optional[_Union[MemoryInfo, _Mapping]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., weights_version: _Optional[str] = ..., weight_updates: _Optional[_Iterable[_Union[WeightUpdate, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_adapters: _Optional[int] = ..., weights_checksum: _Optional[str] = ..., prompt_cache: _Optional[_Union[PromptCacheStats, _Mapping]] = ..., cache: _Optional[_Union[CacheStats, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., step_schedule: _Optional[str] = ..., device_busy_s: _Optional[float] = ...) -> None: ...

class ControlInput(_message.Message):
    __slots__ = ("name", "image", "conditioning_scale", "guidance_start", "guidance_end")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CONDITIONING_SCALE_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_START_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_END_FIELD_NUMBER: _ClassVar[int]
    name: str
    image: bytes
    conditioning_scale: float
    guidance_start: float
    guidance_end: float
    def __init__(self, name: _Optional[str] = ..., image: _Optional[bytes] = ..., conditioning_scale: _Optional[float] = ..., guidance_start: _Optional[float] = ..., guidance_end: _Optional[float] = ...) -> None: ...

class ImagePrompt(_message.Message):
    __slots__ = ("name", "images", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    scale: float
    def __init__(self, name: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., scale: _Optional[float] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "pinned", "components", "digest", "resident", "parameter_bytes", "requests", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    pinned: bool
    components: _containers.RepeatedScalarFieldContainer[str]
    digest: str
    resident: bool
    parameter_bytes: int
    requests: int
    kind: AdapterKind
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., pinned: _Optional[bool] = ..., components: _Optional[_Iterable[str]] = ..., digest: _Optional[str] = ..., resident: _Optional[bool] = ..., parameter_bytes: _Optional[int] = ..., requests: _Optional[int] = ..., kind: _Optional[_Union[AdapterKind, str]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class PushWeightsCommit(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class WeightUpdate(_message.Message):
    __slots__ = ("digest", "components", "pushed")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    digest: str
    components: _containers.RepeatedScalarFieldContainer[str]
    pushed: bool
    def __init__(self, digest: _Optional[str] = ..., components: _Optional[_Iterable[str]] = ..., pushed: _Optional[bool] = ...) -> None: ...

class RunnerTimings(_message.Message):
    __slots__ = ("text_encode_ms", "denoise_ms", "decode_ms", "to_host_ms")
    TEXT_ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    DENOISE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TO_HOST_MS_FIELD_NUMBER: _ClassVar[int]
    text_encode_ms: float
    denoise_ms: float
    decode_ms: float
    to_host_ms: float
    def __init__(self, text_encode_ms: _Optional[float] = ..., denoise_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., to_host_ms: _Optional[float] = ...) -> None: ...

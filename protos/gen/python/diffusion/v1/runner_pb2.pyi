from diffusion.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.RunnerInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.RunnerInfo, _Mapping]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("source", "dtype", "acceleration", "parallel", "component_overrides", "fused_adapters")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    FUSED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    source: str
    dtype: _common_pb2.Dtype
    acceleration: _common_pb2.Acceleration
    parallel: _common_pb2.Parallelism
    component_overrides: _containers.RepeatedCompositeFieldContainer[_common_pb2.ComponentOverride]
    fused_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.FusedAdapter]
    def __init__(self, source: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.Dtype, str]] = ..., acceleration: _Optional[_Union[_common_pb2.Acceleration, _Mapping]] = ..., parallel: _Optional[_Union[_common_pb2.Parallelism, _Mapping]] = ..., component_overrides: _Optional[_Iterable[_Union[_common_pb2.ComponentOverride, _Mapping]]] = ..., fused_adapters: _Optional[_Iterable[_Union[_common_pb2.FusedAdapter, _Mapping]]] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.RunnerInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.RunnerInfo, _Mapping]] = ...) -> None: ...

class ExecuteItem(_message.Message):
    __slots__ = ("request_id", "prompt", "negative_prompt", "width", "height", "num_inference_steps", "guidance_scale", "seed", "num_images", "adapters", "task", "image", "mask_image", "strength", "true_cfg_scale", "cache_threshold", "num_frames", "partial_images", "sampler", "controls", "ip_adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    MASK_IMAGE_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    TRUE_CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    CACHE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
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
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterRef]
    task: _common_pb2.Task
    image: RawImage
    mask_image: RawImage
    strength: float
    true_cfg_scale: float
    cache_threshold: float
    num_frames: int
    partial_images: int
    sampler: str
    controls: _containers.RepeatedCompositeFieldContainer[ExecuteControl]
    ip_adapter: ExecuteImagePrompt
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., num_images: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterRef, _Mapping]]] = ..., task: _Optional[_Union[_common_pb2.Task, str]] = ..., image: _Optional[_Union[RawImage, _Mapping]] = ..., mask_image: _Optional[_Union[RawImage, _Mapping]] = ..., strength: _Optional[float] = ..., true_cfg_scale: _Optional[float] = ..., cache_threshold: _Optional[float] = ..., num_frames: _Optional[int] = ..., partial_images: _Optional[int] = ..., sampler: _Optional[str] = ..., controls: _Optional[_Iterable[_Union[ExecuteControl, _Mapping]]] = ..., ip_adapter: _Optional[_Union[ExecuteImagePrompt, _Mapping]] = ...) -> None: ...

class ExecuteControl(_message.Message):
    __slots__ = ("name", "image", "conditioning_scale", "guidance_start", "guidance_end")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CONDITIONING_SCALE_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_START_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_END_FIELD_NUMBER: _ClassVar[int]
    name: str
    image: RawImage
    conditioning_scale: float
    guidance_start: float
    guidance_end: float
    def __init__(self, name: _Optional[str] = ..., image: _Optional[_Union[RawImage, _Mapping]] = ..., conditioning_scale: _Optional[float] = ..., guidance_start: _Optional[float] = ..., guidance_end: _Optional[float] = ...) -> None: ...

class ExecuteImagePrompt(_message.Message):
    __slots__ = ("name", "images", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    images: _containers.RepeatedCompositeFieldContainer[RawImage]
    scale: float
    def __init__(self, name: _Optional[str] = ..., images: _Optional[_Iterable[_Union[RawImage, _Mapping]]] = ..., scale: _Optional[float] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("items", "progress", "progress_interval_ms")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ExecuteItem]
    progress: bool
    progress_interval_ms: int
    def __init__(self, items: _Optional[_Iterable[_Union[ExecuteItem, _Mapping]]] = ..., progress: _Optional[bool] = ..., progress_interval_ms: _Optional[int] = ...) -> None: ...

class ExecuteProgress(_message.Message):
    __slots__ = ("request_ids", "step", "total_steps", "elapsed_ms", "phase", "previews")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PREVIEWS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    step: int
    total_steps: int
    elapsed_ms: float
    phase: _common_pb2.ProgressPhase
    previews: _containers.RepeatedCompositeFieldContainer[PreviewImage]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., phase: _Optional[_Union[_common_pb2.ProgressPhase, str]] = ..., previews: _Optional[_Iterable[_Union[PreviewImage, _Mapping]]] = ...) -> None: ...

class PreviewImage(_message.Message):
    __slots__ = ("request_id", "image_index", "partial_image_index", "image")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    image_index: int
    partial_image_index: int
    image: RawImage
    def __init__(self, request_id: _Optional[str] = ..., image_index: _Optional[int] = ..., partial_image_index: _Optional[int] = ..., image: _Optional[_Union[RawImage, _Mapping]] = ...) -> None: ...

class ExecuteFrames(_message.Message):
    __slots__ = ("request_id", "video_index", "first_frame", "pixels")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VIDEO_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    video_index: int
    first_frame: int
    pixels: bytes
    def __init__(self, request_id: _Optional[str] = ..., video_index: _Optional[int] = ..., first_frame: _Optional[int] = ..., pixels: _Optional[bytes] = ...) -> None: ...

class RawVideo(_message.Message):
    __slots__ = ("width", "height", "num_frames", "seed")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    num_frames: int
    seed: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ..., num_frames: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class RawImage(_message.Message):
    __slots__ = ("pixels", "width", "height", "channels", "seed")
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    pixels: bytes
    width: int
    height: int
    channels: int
    seed: int
    def __init__(self, pixels: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., channels: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class ExecuteOutput(_message.Message):
    __slots__ = ("request_id", "images", "videos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[RawImage]
    videos: _containers.RepeatedCompositeFieldContainer[RawVideo]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[RawImage, _Mapping]]] = ..., videos: _Optional[_Iterable[_Union[RawVideo, _Mapping]]] = ...) -> None: ...

class ExecuteResult(_message.Message):
    __slots__ = ("outputs", "weights_version", "execute_ms", "timings")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[ExecuteOutput]
    weights_version: str
    execute_ms: float
    timings: _common_pb2.RunnerTimings
    def __init__(self, outputs: _Optional[_Iterable[_Union[ExecuteOutput, _Mapping]]] = ..., weights_version: _Optional[str] = ..., execute_ms: _Optional[float] = ..., timings: _Optional[_Union[_common_pb2.RunnerTimings, _Mapping]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("progress", "result", "frames")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    progress: ExecuteProgress
    result: ExecuteResult
    frames: ExecuteFrames
    def __init__(self, progress: _Optional[_Union[ExecuteProgress, _Mapping]] = ..., result: _Optional[_Union[ExecuteResult, _Mapping]] = ..., frames: _Optional[_Union[ExecuteFrames, _Mapping]] = ...) -> None: ...

class RunnerServiceSleepRequest(_message.Message):
    __slots__ = ("level", "tags")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    level: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, level: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class RunnerServiceSleepResponse(_message.Message):
    __slots__ = ("freed_bytes", "weight_bytes_released", "memory_before", "memory_after", "info")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BEFORE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AFTER_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    weight_bytes_released: int
    memory_before: _common_pb2.MemoryInfo
    memory_after: _common_pb2.MemoryInfo
    info: _common_pb2.RunnerInfo
    def __init__(self, freed_bytes: _Optional[int] = ..., weight_bytes_released: _Optional[int] = ..., memory_before: _Optional[_Union[_common_pb2.MemoryInfo, _Mapping]] = ..., memory_after: _Optional[_Union[_common_pb2.MemoryInfo, _Mapping]] = ..., info: _Optional[_Union[_common_pb2.RunnerInfo, _Mapping]] = ...) -> None: ...

class RunnerServiceWakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class RunnerServiceWakeUpResponse(_message.Message):
    __slots__ = ("weight_bytes_restored", "info")
    WEIGHT_BYTES_RESTORED_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    weight_bytes_restored: int
    info: _common_pb2.RunnerInfo
    def __init__(self, weight_bytes_restored: _Optional[int] = ..., info: _Optional[_Union[_common_pb2.RunnerInfo, _Mapping]] = ...) -> None: ...

class RunnerServiceLoadWeightsRequest(_message.Message):
    __slots__ = ("path", "expected_digest")
    PATH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    path: str
    expected_digest: str
    def __init__(self, path: _Optional[str] = ..., expected_digest: _Optional[str] = ...) -> None: ...

class RunnerServiceLoadWeightsResponse(_message.Message):
    __slots__ = ("loaded_names", "weights_version", "update")
    LOADED_NAMES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    loaded_names: _containers.RepeatedScalarFieldContainer[str]
    weights_version: str
    update: _common_pb2.WeightUpdate
    def __init__(self, loaded_names: _Optional[_Iterable[str]] = ..., weights_version: _Optional[str] = ..., update: _Optional[_Union[_common_pb2.WeightUpdate, _Mapping]] = ...) -> None: ...

class RunnerServiceLoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "pin", "expected_digest", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    pin: bool
    expected_digest: str
    kind: _common_pb2.AdapterKind
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., pin: _Optional[bool] = ..., expected_digest: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.AdapterKind, str]] = ...) -> None: ...

class RunnerServiceLoadAdapterResponse(_message.Message):
    __slots__ = ("adapter", "info")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterInfo
    info: _common_pb2.RunnerInfo
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterInfo, _Mapping]] = ..., info: _Optional[_Union[_common_pb2.RunnerInfo, _Mapping]] = ...) -> None: ...

class RunnerServiceUnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RunnerServiceUnloadAdapterResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.RunnerInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.RunnerInfo, _Mapping]] = ...) -> None: ...

class RunnerServicePushWeightsRequest(_message.Message):
    __slots__ = ("chunk", "commit", "chunks")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TensorChunk
    commit: _common_pb2.PushWeightsCommit
    chunks: _common_pb2.TensorChunks
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., commit: _Optional[_Union[_common_pb2.PushWeightsCommit, _Mapping]] = ..., chunks: _Optional[_Union[_common_pb2.TensorChunks, _Mapping]] = ...) -> None: ...

class RunnerServicePushWeightsResponse(_message.Message):
    __slots__ = ("loaded_names", "weights_version", "checksum", "update", "bytes_received")
    LOADED_NAMES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    loaded_names: _containers.RepeatedScalarFieldContainer[str]
    weights_version: str
    checksum: str
    update: _common_pb2.WeightUpdate
    bytes_received: int
    def __init__(self, loaded_names: _Optional[_Iterable[str]] = ..., weights_version: _Optional[str] = ..., checksum: _Optional[str] = ..., update: _Optional[_Union[_common_pb2.WeightUpdate, _Mapping]] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class RunnerServiceGetWeightsChecksumRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunnerServiceGetWeightsChecksumResponse(_message.Message):
    __slots__ = ("checksum", "weights_version")
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    checksum: str
    weights_version: str
    def __init__(self, checksum: _Optional[str] = ..., weights_version: _Optional[str] = ...) -> None: ...

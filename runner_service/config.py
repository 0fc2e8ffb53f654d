"""Everything the runner is started with: each field is a ``diffusion-runner`` flag (and a
``DIFFUSION_RUNNER_<FLAG>`` variable). Torch-free, so that ``--help`` answers at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from runner_service.limits import (
    DEFAULT_MAX_ADAPTERS,
    DEFAULT_MAX_CONTROLNET_BYTES,
    DEFAULT_PROMPT_CACHE_BYTES,
    BatchLimits,
)
from serving_common.channels import DEFAULT_MAX_MESSAGE_BYTES
from serving_common.config_flags import option
from serving_common.protocol import DTYPES

MIN_MESSAGE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class RunnerConfig:
    """The runner's flags, as the runner reads them."""

    PROG: ClassVar[str] = "diffusion-runner"
    ENV_PREFIX: ClassVar[str] = "DIFFUSION_RUNNER_"

    listen: str = option("127.0.0.1:50052", "host:port or unix:/path")
    device: str = option("auto", "auto, cpu, cuda[:N] or npu[:N]")
    devices: str = option(
        "", "a runner group, one process per device, that spreads each request over them as the worker's Init "
        "says (InitRequest.parallel): N (devices 0..N-1 of --device's kind; N processes for cpu) or a list such "
        "as cuda:0,cuda:1; rank 0 serves, the others follow it; empty: one device (--device)")
    group_heartbeat_timeout: float = option(
        5.0, "seconds a rank of a runner group (--devices) may miss the ranks' heartbeat (stopped, wedged) before "
        "the group ends, rank 0 with exit code 3 as when a rank dies, so that a fresh group replaces it",
        above=0)
    model: str = option("", "model to load at start (normally the worker asks)")
    dtype: str | None = option(None, "dtype for --model (default: the platform's)", choices=sorted(DTYPES))
    threads: int = option(0, "torch intra-op threads (0: torch's default)")
    model_cache: Path | None = option(None, "where built-in models are built")
    allow_download: bool = option(
        False, "a Hugging Face id (org/name[@revision]) missing from the hub cache (HF_HUB_CACHE, by default "
        "$HF_HOME/hub) is downloaded, with the hub's token from the environment (HF_TOKEN), instead of refused "
        "NOT_FOUND; off: nothing is ever downloaded")
    single_file_config: tuple[str, ...] = option(
        (), "a diffusers model (a directory, a Hugging Face id in the hub cache or a built-in such as tiny) whose "
        "configs a single-file checkpoint (.safetensors, the A1111/ComfyUI layout) of its family is loaded with "
        "(repeatable): the one of the file's pipeline class, or the only one given where the keys do not tell the "
        "family; none: the family's reference repository in the hub cache (docs/models.md)")
    spill_dir: Path | None = option(None, "CPU sleep level 1 spill files (default: a private temporary directory); "
                                    "a runner group's other ranks spill into rank-N inside it")
    model_root: tuple[Path, ...] = option(
        (), "directory LoadModel and LoadWeights may read under (repeatable; none: any)")
    auth_token_file: str = option(
        "", "file holding the token callers must send (authorization: Bearer); none: no check")
    grace: float = option(30.0, "seconds to finish work on SIGTERM; a step still running after them (it cannot "
                          "be interrupted) is not waited for: the process exits")
    overrun_exit_after: float = option(
        30.0, "seconds a denoising step or decode may go on after every request it serves has gone (deadline "
        "passed, cancelled) before the runner exits with code 4 so that a fresh one replaces it (a step cannot "
        "be interrupted; the work stops at the next step boundary otherwise); 0: never", at_least=0)
    max_message_bytes: int = option(
        DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message sent or received (an Execute result holds a whole "
        "batch of raw images); at least 1 MiB", at_least=MIN_MESSAGE_BYTES)
    max_weights_bytes: int = option(
        0, "most bytes one LoadWeights reads (0: twice the loaded model's parameter bytes, at least 64 MiB)",
        at_least=0)
    max_adapters: int = option(
        DEFAULT_MAX_ADAPTERS, "LoRA adapters resident at once; the least recently used unpinned one is evicted",
        at_least=1)
    max_controlnet_bytes: int = option(
        DEFAULT_MAX_CONTROLNET_BYTES, "bytes of ControlNets (LoadAdapter, ADAPTER_KIND_CONTROLNET) on the device at "
        "once; past it the least recently used unpinned one is evicted (it loads again from its path when a "
        "request names it)", at_least=1)
    max_batch_images: int = option(
        BatchLimits.max_batch_images, "most images in one Execute (the worker's batches stay below)", at_least=1)
    batching: str = option(
        "step", "step: requests of the tasks a family's step-level loop runs (docs/families.md, 'Step-level "
        "batching') join the running batch at the next denoising step, the others run request by request; "
        "request: each Execute runs as one pipeline call",
        choices=["step", "request"])
    step_schedule: str = option(
        "all", "all: every size group of a step batch advances at every step; budget: size groups take turns by "
        "their compute (rows x pixels, deficit round robin), so small images are not slowed by the large ones "
        "beside them, and the worker, seeing it in RunnerInfo.step_schedule, schedules by compute too (size "
        "classes in turns, runners filled by images x pixels) while every ready runner runs budget",
        choices=["all", "budget"])
    prompt_cache_bytes: int = option(
        DEFAULT_PROMPT_CACHE_BYTES, "encoded prompts kept for step-level batching, in bytes (0: off)", at_least=0)
    max_size: int = option(
        0, "largest width or height (0: the platform's: 512 on a CPU, 2048 on an accelerator); reported to the "
        "worker as the model's max_size", at_least=0)
    max_steps: int = option(BatchLimits.max_steps, "most denoising steps", at_least=1)
    max_frames: int = option(
        BatchLimits.max_frames, "most frames of one video (a model's own limit may be lower)", at_least=1)
    decode_budget_bytes: int = option(
        BatchLimits.decode_budget_bytes, "peak bytes a video's VAE decode may take: the tiles are sized to stay "
        "within it by an estimate, a video whose smallest tiles exceed it is refused (0: diffusers' default "
        "tiles, unbounded)", at_least=0)
    log_level: str = option("INFO", "debug, info, warning or error")
    log_json: bool = option(False, "log one JSON object per line")

    def batch_limits(self, platform_max_size: int) -> BatchLimits:
        """The runner's own bounds on a batch, ``--max-size`` 0 being the platform's largest side."""
        return BatchLimits(max_batch_images=self.max_batch_images, max_size=self.max_size or platform_max_size,
                           max_steps=self.max_steps, max_frames=self.max_frames,
                           decode_budget_bytes=self.decode_budget_bytes)

    @property
    def step_batching(self) -> bool:
        """Whether requests join the running batch at the next denoising step (``--batching step``)."""
        return self.batching == "step"

"""Flags generated from config dataclasses (serving_common.config_flags): environment defaults, flags
over the environment, nested groups, bounds and choices, the help, and the generated
docs/configuration.md. In-process: no service is started."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from harness.processes import REPO
from runner_service.config import RunnerConfig
from serving_common import config_docs
from serving_common.config_flags import flags, group, option, parse_config
from worker_service.config import WorkerConfig

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Inner:
    timeout: float = option(1.5, "seconds to wait", above=0)
    size: int = option(4, "items at once", at_least=1, at_most=10)


@dataclass(frozen=True)
class Sample:
    PROG: ClassVar[str] = "sample"
    ENV_PREFIX: ClassVar[str] = "SAMPLE_"

    name: str = option("fox", "a name")
    count: int = option(3, "how many", at_least=1)
    verbose: bool = option(False, "say more")
    targets: tuple[str, ...] = option(("a:1",), "a target; repeat for several", flag="--target")
    roots: tuple[Path, ...] = option((), "directories; none: any", flag="--root")
    cache: Path | None = option(None, "where to cache (default: nowhere)")
    mode: str = option("fast", "how", choices=["fast", "slow"])
    level: int = option(0, "how high; auto: the default", choices={"auto": 0, "high": 2})
    inner: Inner = group(Inner, title="inner things", prefix="inner-")
    internal: int = 7  # no flag


def parse(*argv: str, check=None) -> Sample:
    return parse_config(Sample, list(argv), description="a sample", check=check)


def error_of(capsys, *argv: str, check=None) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(*argv, check=check)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_no_flags_give_the_dataclass_defaults():
    assert parse() == Sample()


def test_every_flag_sets_its_field():
    config = parse("--name", "owl", "--count", "5", "--verbose", "--target", "b:2", "--target", "c:3", "--root", "/r",
                   "--cache", "/c", "--mode", "slow", "--level", "high", "--inner-timeout", "2", "--inner-size", "9")
    assert config == Sample(name="owl", count=5, verbose=True, targets=("b:2", "c:3"), roots=(Path("/r"),),
                            cache=Path("/c"), mode="slow", level=2, inner=Inner(timeout=2.0, size=9))


def test_the_environment_sets_defaults(monkeypatch):
    for variable, value in {"SAMPLE_COUNT": "5", "SAMPLE_VERBOSE": "yes", "SAMPLE_TARGET": "b:2,c:3",
                            "SAMPLE_ROOT": "/r", "SAMPLE_LEVEL": "high", "SAMPLE_INNER_TIMEOUT": "2.5"}.items():
        monkeypatch.setenv(variable, value)
    config = parse()
    assert (config.count, config.verbose, config.targets, config.roots) == (5, True, ("b:2", "c:3"), (Path("/r"),))
    assert (config.level, config.inner.timeout) == (2, 2.5)
    monkeypatch.setenv("SAMPLE_VERBOSE", "no")
    assert parse().verbose is False


def test_a_flag_beats_its_environment_variable(monkeypatch):
    monkeypatch.setenv("SAMPLE_COUNT", "5")
    monkeypatch.setenv("SAMPLE_TARGET", "b:2,c:3")
    config = parse("--count", "6", "--target", "d:4")
    assert (config.count, config.targets) == (6, ("d:4",))  # the repeated flag replaces, not adds to, the variable


def test_nested_groups_and_plain_fields(capsys):
    assert parse("--inner-size", "2").inner == Inner(size=2)
    assert "unrecognized arguments: --internal" in error_of(capsys, "--internal", "8")
    assert "unrecognized arguments: --size" in error_of(capsys, "--size", "2")  # a group's flags carry its prefix


@pytest.mark.parametrize("argv, message", [
    (["--count", "0"], "--count must be >= 1"),
    (["--inner-timeout", "0"], "--inner-timeout must be > 0"),
    (["--inner-timeout", "nan"], "--inner-timeout must be > 0"),
    (["--inner-size", "11"], "--inner-size must be 1 to 10"),
    (["--count", "0", "--inner-size", "0"], "--count must be >= 1; --inner-size must be 1 to 10"),
    (["--mode", "medium"], "argument --mode: invalid choice: 'medium'"),
    (["--level", "2"], "argument --level: invalid choice: '2'"),
])
def test_values_out_of_bounds_are_usage_errors(capsys, argv, message):
    assert message in error_of(capsys, *argv)


def test_environment_values_are_checked_like_flags(capsys, monkeypatch):
    monkeypatch.setenv("SAMPLE_MODE", "medium")  # argparse checks the choices of command-line values only
    assert error_of(capsys).endswith("--mode must be one of fast, slow, not 'medium'")
    monkeypatch.delenv("SAMPLE_MODE")
    monkeypatch.setenv("SAMPLE_LEVEL", "2")
    assert error_of(capsys).endswith("--level must be one of auto, high, not '2'")
    monkeypatch.delenv("SAMPLE_LEVEL")
    monkeypatch.setenv("SAMPLE_COUNT", "many")
    assert "SAMPLE_COUNT: invalid literal for int()" in error_of(capsys)
    monkeypatch.setenv("SAMPLE_COUNT", "0")
    assert error_of(capsys).endswith("--count must be >= 1")


def test_a_check_refusal_is_a_usage_error(capsys):
    def check(config: Sample) -> None:
        if config.name == config.mode:
            raise ValueError("--name must differ from --mode")

    assert parse(check=check) == Sample()
    assert error_of(capsys, "--name", "fast", check=check).endswith("sample: error: --name must differ from --mode")


def test_help_names_each_variable_and_shows_the_defaults_that_say_something(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--count COUNT how many [env SAMPLE_COUNT] (default: 3)" in text
    assert "--verbose say more [env SAMPLE_VERBOSE] (default: False)" in text
    assert "[env SAMPLE_TARGET] (default: a:1)" in text and text.count("a:1") == 1
    assert "--level {auto,high} how high; auto: the default [env SAMPLE_LEVEL] (default: auto)" in text
    assert "inner things: --inner-timeout INNER_TIMEOUT seconds to wait [env SAMPLE_INNER_TIMEOUT] (default: 1.5)" \
        in text
    assert "(default: None)" not in text and "(default: ())" not in text and "(default: [])" not in text


def test_the_services_flags_are_their_public_contract():
    """The flag names of both services: the deployment manifests, docs and users' scripts use them."""
    worker = [flag.name for flag in flags(WorkerConfig)]
    runner = [flag.name for flag in flags(RunnerConfig)]
    assert sorted(worker) == sorted([
        "--listen", "--runner", "--model", "--dtype", "--cache", "--cache-threshold", "--cache-warmup-steps",
        "--compile", "--quantization", "--attention-backend", "--auto-wake", "--max-queue", "--max-input-bytes",
        "--max-receiving-requests", "--receive-timeout", "--grace", "--min-size", "--max-size", "--max-steps",
        "--max-images", "--max-prompt-chars", "--max-guidance", "--max-batch-size", "--max-batch-delay-ms",
        "--schedule", "--max-runner-wait", "--runner-keepalive", "--runner-stall-timeout", "--runner-poll-interval",
        "--state-file", "--push-dir", "--max-pushed-bytes", "--log-level", "--log-json", "--metrics-port",
        "--http-port", "--http-max-connections", "--http-header-timeout", "--http-body-timeout",
        "--http-max-body-bytes-in-flight", "--ops-token-file", "--inference-token-file", "--runner-token-file",
        "--tls-cert", "--tls-key", "--tls-client-ca", "--max-message-bytes", "--sleep-after-idle",
        "--idle-sleep-level", "--stream-chunk-bytes", "--max-video-jobs", "--max-video-bytes", "--video-job-ttl-s",
        "--cfg-parallel", "--ulysses-degree", "--ring-degree", "--no-image-parameters", "--max-image-urls",
        "--max-image-url-bytes", "--image-url-ttl-s", "--component", "--fuse-lora", "--served-model-name",
        "--default-size", "--default-steps", "--default-guidance", "--result-cache-bytes", "--result-cache-entries"])
    assert sorted(runner) == sorted([
        "--listen", "--device", "--model", "--dtype", "--threads", "--model-cache", "--spill-dir", "--model-root",
        "--auth-token-file", "--grace", "--max-message-bytes", "--max-weights-bytes", "--max-adapters",
        "--max-batch-images", "--batching", "--step-schedule", "--prompt-cache-bytes", "--max-size", "--max-steps",
        "--log-level", "--log-json", "--max-frames", "--decode-budget-bytes", "--devices", "--group-heartbeat-timeout",
        "--overrun-exit-after", "--allow-download", "--single-file-config", "--max-controlnet-bytes"])
    assert all(flag.option.help for flag in [*flags(WorkerConfig), *flags(RunnerConfig)])


def test_the_configuration_page_is_generated_from_the_flags(capsys):
    page = REPO / "docs" / "configuration.md"
    assert config_docs.main(["--check", str(page)]) == 0, capsys.readouterr().err
    text = page.read_text()
    assert "| `--max-queue` | integer, at least 1 | `64` | `DIFFUSION_WORKER_MAX_QUEUE` |" in text
    assert "| `--model-root` | path, repeatable | none | `DIFFUSION_RUNNER_MODEL_ROOT` |" in text

"""The ``diffusion`` CLI as a user meets it: bad arguments, help texts, errors, the request id and
``diffusion requests``. The CLI runs in-process, or as a real subprocess where its output is read as it
comes or a terminal matters; the last tests use the session's worker and runner (tiny_pair)."""

from __future__ import annotations

import os
import pty
import subprocess
import threading
import time

import pytest
from PIL import Image

from clients import DiffusionClient, Done, GeneratedImage, GenerateResult
from clients.cli import requests_table
from clients.types import Timings
from diffusion.v1 import worker_pb2
from harness.processes import REPO, free_port, start_worker
from support import cli, cli_command, cli_env

pytestmark = pytest.mark.timeout(120)
COMMANDS = ["generate", "status", "requests", "sleep", "wake", "load-weights", "init", "cancel", "health"]
NOBODY = "127.0.0.1:1"  # nothing listens on port 1


# --- arguments and help, no worker needed --------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("flag, value, says", [
    ("--width", "-64", "must be at least 1"),
    ("--height", "0", "must be at least 1"),
    ("--steps", "-1", "must be at least 1"),
    ("--steps", "0", "must be at least 1"),
    ("--seed", "-1", "must be at least 0"),
    ("--num-images", "-2", "must be at least 1"),
    ("--guidance", "-0.5", "must be a finite number >= 0"),
    ("--guidance", "nan", "must be a finite number >= 0"),
    ("--seed", "x", "must be a whole number"),
])
def test_bad_generate_values_are_refused_by_argparse(flag, value, says, tmp_path):
    done = cli("--target", NOBODY, "generate", "a fox", "-o", str(tmp_path / "x.png"), flag, value)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [error] = [line for line in done.stderr.splitlines() if "error:" in line]
    assert error.startswith(f"diffusion generate: error: argument {flag}: {says}, not "), error
    assert not (tmp_path / "x.png").exists()


@pytest.mark.unit
@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_has_no_rest_markup(command):
    done = cli(*([command] if command else []), "--help")
    assert done.returncode == 0, done.stderr
    assert "``" not in done.stdout and done.stdout.strip()


@pytest.mark.unit
def test_load_weights_help_explains_the_tensor_names():
    done = cli("load-weights", "--help")
    assert "<component>.<param>" in done.stdout and "unet.conv_in.weight" in done.stdout


@pytest.mark.unit
def test_main_help_lists_requests():
    assert "requests" in cli("--help").stdout


@pytest.mark.unit
def test_an_unreachable_worker_is_reported_once():
    done = cli("--target", NOBODY, "--timeout", "5", "status")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: UNAVAILABLE: "), done.stderr
    assert done.stderr.count("error: UNAVAILABLE") == 1 and "Traceback" not in done.stderr


@pytest.mark.unit
def test_an_unreadable_tls_file_is_a_clean_error(tmp_path):
    done = cli("--target", NOBODY, "--tls-ca", str(tmp_path / "missing.pem"), "status")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("missing.pem") == 1


# --- types and the requests table, in process ----------------------------------------------------

@pytest.mark.unit
def test_generated_image_repr_summarises_the_bytes():
    image = GeneratedImage(data=b"\x89PNG" + bytes(12341), mime_type="image/png", width=640, height=480, seed=7)
    assert repr(image) == "GeneratedImage(640x480 image/png, 12345 bytes, seed 7)"
    result = GenerateResult(request_id="r1", images=[image, image], weights_version="", timings=Timings(),
                            model="tiny")
    assert len(repr(Done(result=result))) < 400 and "\\x00" not in repr(Done(result=result))


@pytest.mark.unit
def test_requests_table():
    assert requests_table([]) == "no active requests"
    table = requests_table([
        worker_pb2.ActiveRequest(request_id="abc", state="running", step=3, total_steps=20, age_ms=1500),
        worker_pb2.ActiveRequest(request_id="a-much-longer-id", state="queued", position=0, age_ms=125_000),
    ]).splitlines()
    assert table[0].split() == ["REQUEST", "STATE", "POSITION", "STEP", "AGE"]
    assert table[1].split() == ["abc", "running", "-", "3/20", "1.5s"]
    assert table[2].split() == ["a-much-longer-id", "queued", "0", "-", "2m05s"]
    assert table[1].index("running") == table[0].index("STATE") == table[2].index("queued")


# --- against a real worker -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner(tiny_pair):
    return tiny_pair.runner


@pytest.fixture(scope="module")
def worker(tiny_pair):
    return tiny_pair.worker


class Generation:
    """``diffusion generate`` as a child process, its stderr collected as it comes (the bar has no newlines)."""

    def __init__(self, target: str, out: str, *args: str) -> None:
        self.process = subprocess.Popen(cli_command("--target", target, "generate", "a fox", "-o", out, *args),
                                        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while chunk := os.read(self.process.stderr.fileno(), 4096):  # type: ignore[union-attr]
            self.chunks.append(chunk)

    @property
    def stderr(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr:
            assert self.process.poll() is None or self.reader.is_alive(), f"exited before {text!r}:\n{self.stderr}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout}s:\n{self.stderr}"
            time.sleep(0.05)

    def request_id(self) -> str:
        self.wait_for(" started\n")
        [line] = [line for line in self.stderr.splitlines() if line.endswith(" started")][:1]
        return line.split()[1]

    def finish(self, timeout: float = 60.0) -> int:
        code = self.process.wait(timeout)
        self.reader.join(5)
        return code


@pytest.mark.process
def test_generate_prints_the_request_id_when_it_starts(worker, tmp_path):
    run = Generation(worker.target, str(tmp_path / "fox.png"), "--steps", "3", "--seed", "1")
    assert run.finish() == 0, run.stderr
    request_id = run.request_id()
    assert f"request {request_id} started\n" in run.stderr and len(request_id) >= 8
    assert run.stderr.index("started") < run.stderr.index("3/3")
    assert run.process.stdout.read().decode().count(request_id) == 1  # type: ignore[union-attr]


@pytest.mark.process
def test_a_cancel_during_the_progress_bar_starts_a_new_line(worker, tmp_path):
    run = Generation(worker.target, str(tmp_path / "fox.png"), "--steps", "500")
    request_id = run.request_id()
    run.wait_for("] 1/500")
    with DiffusionClient(worker.target, timeout=10) as client:
        assert client.cancel(request_id) == "running"
    assert run.finish() == 1
    lines = run.stderr.split("\n")
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: CANCELLED: "), run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.process
def test_field_violations_are_printed_once(worker, tmp_path):
    done = cli("--target", worker.target, "generate", "a fox", "-o", str(tmp_path / "x.png"),
               "--width", "65", "--height", "13")
    assert done.returncode == 1 and done.stderr.startswith("error: INVALID_ARGUMENT: ")
    assert done.stderr.count("got 65") == 1 and done.stderr.count("got 13") == 1, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.process
def test_requests_lists_a_running_request(worker, tmp_path):
    assert cli("--target", worker.target, "requests").stdout.strip() == "no active requests"
    run = Generation(worker.target, str(tmp_path / "fox.png"), "--steps", "500")
    try:
        request_id = run.request_id()
        run.wait_for("] 1/500")  # off a terminal the bar is printed at the first step and each tenth
        done = cli("--target", worker.target, "requests")
        assert done.returncode == 0, done.stderr
        header, *rows = done.stdout.splitlines()
        assert header.split() == ["REQUEST", "STATE", "POSITION", "STEP", "AGE"]
        [row] = [row.split() for row in rows if row.startswith(request_id)]
        assert row[1] == "running" and row[2] == "-" and row[3].endswith("/500") and row[4].endswith("s")
    finally:
        with DiffusionClient(worker.target, timeout=10) as client:
            try:
                client.cancel(run.request_id())
            except Exception:  # it may have ended already
                pass
        run.finish()
    assert cli("--target", worker.target, "requests").stdout.strip() == "no active requests"


# --- output formats, progress lines, --wait (issue 21) ------------------------------------------

@pytest.mark.process
@pytest.mark.parametrize("name, format_", [("fox.jpg", "JPEG"), ("fox.JPEG", "JPEG"), ("fox.webp", "WEBP"),
                                           ("fox", "PNG")])
def test_the_output_extension_picks_the_format(worker, tmp_path, name, format_):
    done = cli("--target", worker.target, "generate", "a fox", "-o", str(tmp_path / name), "--steps", "1")
    assert done.returncode == 0, done.stderr
    [written] = tmp_path.iterdir()
    with Image.open(written) as image:
        assert image.format == format_


@pytest.mark.unit
@pytest.mark.parametrize("name, flags, says", [
    ("fox.jpg", ["--format", "png"], "-o {out} names jpeg, but --format is png"),
    ("fox.gif", [], "-o {out}: .gif names no image format"),
])
def test_an_extension_that_names_another_format_is_refused(tmp_path, name, flags, says):
    out = tmp_path / name
    done = cli("--target", NOBODY, "generate", "a fox", "-o", str(out), *flags)
    assert done.returncode == 2 and says.format(out=out) in done.stderr, done.stderr
    assert not out.exists()


@pytest.mark.process
def test_progress_off_a_terminal_is_a_few_plain_lines(worker, tmp_path):
    done = cli("--target", worker.target, "generate", "a fox", "-o", str(tmp_path / "fox.png"), "--steps", "40")
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    bars = [line for line in done.stderr.splitlines() if line.startswith("[")]
    # The first step, then each tenth of the way: 1, 4, 8, ..., 40.
    assert [line.split()[-1] for line in bars] == ["1/40", *[f"{4 * i}/40" for i in range(1, 11)]]


@pytest.mark.process
def test_progress_on_a_terminal_is_one_redrawn_bar(worker, tmp_path):
    controller, terminal = pty.openpty()
    process = subprocess.Popen(cli_command("--target", worker.target, "generate", "a fox", "-o",
                                           str(tmp_path / "fox.png"), "--steps", "12"),
                               cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert process.wait(60) == 0, output
    text = output.decode()
    assert text.count("\r[") == 12 and text.count("/12") == 12 and text.count("12/12\r\n") == 1


@pytest.mark.process
def test_generate_wait_waits_for_a_worker_that_starts_later(runner, tmp_path):
    target = f"127.0.0.1:{free_port()}"
    run = Generation(target, str(tmp_path / "fox.png"), "--wait", "--steps", "1")
    late = None
    try:
        run.wait_for(f"waiting for the worker at {target} to be ready")
        late = start_worker(tmp_path, runner.target, "--model", "tiny", target=target, ready=False)
        assert run.finish(timeout=120) == 0, run.stderr
    finally:
        if run.process.poll() is None:
            run.process.kill()
        if late is not None:
            late.stop()
    with Image.open(tmp_path / "fox.png") as image:
        assert image.format == "PNG"


@pytest.mark.unit
def test_generate_wait_gives_up_at_the_deadline(tmp_path):
    done = cli("--target", NOBODY, "--timeout", "1", "generate", "a fox", "-o", str(tmp_path / "fox.png"), "--wait")
    assert done.returncode == 1 and "error: DEADLINE_EXCEEDED" in done.stderr, done.stderr


@pytest.mark.process
def test_the_runner_log_has_no_library_notices(runner, worker):
    log = runner.log()  # the worker loaded the tiny model on it and generated
    assert "torchvision" not in log and "torch_dtype" not in log and "FutureWarning" not in log, log[-2000:]

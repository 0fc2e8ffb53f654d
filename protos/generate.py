"""Generates the Python gRPC stubs from the .proto files (``make protos``).

The stubs are committed; ``--check`` regenerates into a temporary directory
and fails when the committed ones differ, so a stale stub cannot land.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
OUTPUT = PROTO_ROOT / "gen" / "python"


def generate(output: Path) -> None:
    proto_include = Path(protoc.__file__).parent / "_proto"
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("diffusion/**/*.proto"))
    for package in ("diffusion", "diffusion/v1"):
        (output / package).mkdir(parents=True, exist_ok=True)
        (output / package / "__init__.py").touch()
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{proto_include}", f"--python_out={output}",
            f"--pyi_out={output}", f"--grpc_python_out={output}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def stale_files(expected: Path, actual: Path) -> list[str]:
    """The generated files that differ between the two trees (bytecode an import wrote is no stub)."""
    names = {p.relative_to(expected) for p in expected.rglob("*") if p.is_file()}
    names |= {p.relative_to(actual) for p in actual.rglob("*.py*") if p.is_file() and "__pycache__" not in p.parts}
    return sorted(
        str(name) for name in names
        if not (expected / name).exists() or not (actual / name).exists()
        or not filecmp.cmp(expected / name, actual / name, shallow=False)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        generate(OUTPUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = stale_files(Path(tmp), OUTPUT)
    if stale:
        print("generated stubs are stale; run `make protos`:", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

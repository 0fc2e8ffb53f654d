"""``diffusion-build-model NAME OUTDIR``: writes a built-in model any diffusers code can load."""

from __future__ import annotations

import argparse
from pathlib import Path

from runner_service.models.catalog import BUILTIN_MODELS, save_builtin


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="diffusion-build-model", description=__doc__)
    parser.add_argument("name", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("output_dir", type=Path)
    args = parser.parse_args(argv)
    if (args.output_dir / "model_index.json").exists():
        parser.error(f"{args.output_dir} already holds a model")
    print(save_builtin(args.name, args.output_dir))


if __name__ == "__main__":
    main()

"""diffusion-build-model NAME OUTDIR: writes a built-in model in diffusers format, which any
diffusers code can load with from_pretrained: the trained shapes model as shipped, the others built
from real configs with seeded random weights."""

from __future__ import annotations

from pathlib import Path

from runner_service.libraries import quiet_libraries
from serving_common.flags import StrictParser
from serving_common.protocol import BUILTIN_MODEL_NAMES


def main(argv: list[str] | None = None) -> None:
    parser = StrictParser(prog="diffusion-build-model", description=__doc__)
    parser.add_argument("name", choices=BUILTIN_MODEL_NAMES)
    parser.add_argument("output_dir", type=Path)
    args = parser.parse_args(argv)
    if (args.output_dir / "model_index.json").exists():
        parser.error(f"{args.output_dir} already holds a model")
    quiet_libraries()
    from runner_service.models.catalog import save_builtin  # torch and diffusers: after the flags

    print(save_builtin(args.name, args.output_dir))


if __name__ == "__main__":
    main()

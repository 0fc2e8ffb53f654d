"""diffusion-build-model NAME OUTDIR: writes a built-in model in diffusers format, which any
diffusers code can load with from_pretrained: the trained shapes model as shipped, the others built
from real configs with seeded random weights; or a built-in IP-Adapter (tiny-ip-adapter for tiny,
tiny-sdxl-ip-adapter for tiny-sdxl) in the layout diffusers' load_ip_adapter reads, or a built-in
ControlNet (tiny-controlnet for tiny, tiny-sdxl-controlnet, tiny-sd3-controlnet and tiny-flux-controlnet for
tiny-sdxl, tiny-sd3 and tiny-flux): a diffusers ControlNet directory."""

from __future__ import annotations

from pathlib import Path

from runner_service.libraries import quiet_libraries
from serving_common.flags import StrictParser
from serving_common.protocol import BUILTIN_MODEL_NAMES

# The built-in ControlNets (``models.controlnets.BUILT_CONTROLNETS``, named here without importing torch).
BUILT_CONTROLNET_NAMES = ("tiny-controlnet", "tiny-sdxl-controlnet", "tiny-sd3-controlnet", "tiny-flux-controlnet")

# The built-in IP-Adapters (``tiny_ip_adapters.BUILT_IP_ADAPTERS``, named here without importing torch).
BUILT_IP_ADAPTER_NAMES = ("tiny-ip-adapter", "tiny-sdxl-ip-adapter")


def main(argv: list[str] | None = None) -> None:
    parser = StrictParser(prog="diffusion-build-model", description=__doc__)
    parser.add_argument("name", choices=(*BUILTIN_MODEL_NAMES, *BUILT_IP_ADAPTER_NAMES, *BUILT_CONTROLNET_NAMES))
    parser.add_argument("output_dir", type=Path)
    args = parser.parse_args(argv)
    if (args.output_dir / "model_index.json").exists():
        parser.error(f"{args.output_dir} already holds a model")
    quiet_libraries()
    if args.name in BUILT_CONTROLNET_NAMES:
        if args.output_dir.exists():
            parser.error(f"{args.output_dir} exists already")
        from runner_service.models.controlnets import save_controlnet  # torch and diffusers: after the flags

        print(save_controlnet(args.name, args.output_dir))
        return
    if args.name in BUILT_IP_ADAPTER_NAMES:
        if args.output_dir.exists():
            parser.error(f"{args.output_dir} exists already")
        from runner_service.models.tiny_ip_adapters import save_ip_adapter  # torch and diffusers: after the flags

        print(save_ip_adapter(args.name, args.output_dir))
        return
    from runner_service.models.catalog import save_builtin  # torch and diffusers: after the flags

    print(save_builtin(args.name, args.output_dir))


if __name__ == "__main__":
    main()

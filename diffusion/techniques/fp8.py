"""FP8 training of a transformer's block linears through torchao's float8 (``fp8=tensorwise`` or ``rowwise``), as a
technique: each linear layer of the family's repeated blocks becomes torchao's ``Float8Linear`` (its matmuls in
float8 with dynamic scales, its weights and optimizer state in full precision), before FSDP2 shards and compile
traces them. A filter decides which layers convert, each with its reason:

- only the stacks the family names in ``BLOCKS``: embedders, the final norm and projection stay (small, and at the
  model's edges where precision matters most);
- not the block layers the family keeps in ``FP8_KEEP``: the adaLN modulation layers, fed one vector per sample, whose
  GEMM has as many rows as the batch has samples (FP8's scaling costs more than it saves there);
- not a layer whose sides are not multiples of 16 (what torch's FP8 matmul takes).

MFU on the results line stays bf16 model FLOPs over the GPU's bf16 peak (the ``fp8`` entry says so). torchao is
imported only when asked (``pip install -e '.[fp8]'``) and the run refused in one line where the GPU has no FP8
tensor cores (compute capability below 8.9) or there is no GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from diffusion.errors import UsageError, spell
from diffusion.settings import OneOf, setting
from diffusion.techniques.technique import Technique

RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name
CONVERTED = "converted"
MFU_BASIS = "bf16 model FLOPs over the bf16 peak"


@dataclass
class Fp8Settings:
    fp8: Optional[str] = setting(
        None,
        "FP8 training of the transformer blocks' linear layers through torchao (tensorwise: one scale per tensor, the "
        "fastest; rowwise: one per row, closer to bf16): a GPU with FP8 tensor cores (H100, H200, L40S, B200), "
        "amp_bf16, torchao installed (pip install -e '.[fp8]'); pays with --compile",
        OneOf(RECIPES),
        shown="off",
    )


def decisions(family: type, part) -> dict[str, str]:
    """Every linear layer of the trained ``part`` (its name in the part) -> ``CONVERTED`` or why it stays."""
    import torch

    stacks = {attribute for attribute, _ in (family.BLOCKS or {}).values()}
    keep = family.FP8_KEEP or ()
    found = {}
    for name, module in part.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name.split(".")[0] not in stacks:
            found[name] = "outside the repeated blocks"
        elif any(name == k or name.endswith("." + k) for k in keep):
            found[name] = "per-sample modulation"
        elif module.in_features % 16 or module.out_features % 16:
            found[name] = "sides not multiples of 16"
        else:
            found[name] = CONVERTED
    return found


def convert(family: type, part, recipe: str) -> None:
    """The part's block linears swapped for torchao's Float8Linear in place, as ``decisions`` says."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    found = decisions(family, part)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(part, config=config, module_filter_fn=lambda _, name: found.get(name) == CONVERTED)


class Fp8(Technique):
    NAME = "fp8"
    SETTINGS = Fp8Settings
    SWITCH = "fp8"

    @classmethod
    def check(cls, cfg, family: type, denoiser_config: dict) -> None:
        """A transformer family, bf16 autocast, no LoRA, torchao importable, a GPU with FP8 tensor cores."""
        import torch

        given = spell("fp8", cfg.fp8)
        if family.FP8_KEEP is None or not family.BLOCKS:
            raise UsageError(
                f"{given}: FP8 converts a transformer's block linears; {cfg.model_name} is {family.DESCRIPTION}, "
                "which offers none (FP8 is for FLUX, FLUX.2, SD3, Qwen-Image and Z-Image)"
            )
        if getattr(cfg, "lora_rank", None):
            raise UsageError(
                f"{given} trains the denoiser's own linears in FP8; with {spell('lora_rank')} they are frozen: drop "
                f"one (a frozen base's memory: {spell('lora_base_dtype')})"
            )
        if cfg.precision not in (None, "amp_bf16"):
            raise UsageError(f"{given} trains under amp_bf16, not {spell('precision', cfg.precision)}: drop precision")
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise UsageError(f"{given} needs torchao: pip install -e '.[fp8]' (or pip install torchao)") from None
        if not torch.cuda.is_available():
            raise UsageError(f"{given} needs a GPU with FP8 tensor cores (compute capability 8.9 or newer); none here")
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise UsageError(
                f"{given}: {torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no FP8 tensor "
                "cores (8.9 or newer: L40S, H100, H200, B200); drop fp8"
            )

    @classmethod
    def install(cls, cfg, model) -> list:
        from diffusion.models.base import denoiser_of

        convert(type(model), denoiser_of(model), cfg.fp8)
        return []

    @classmethod
    def results(cls, cfg, model) -> dict:
        from torchao.float8.float8_linear import Float8Linear

        from diffusion.models.base import denoiser_of

        layers = [type(m) for m in denoiser_of(model).modules()]
        converted = sum(issubclass(t, Float8Linear) for t in layers)
        return {"recipe": cfg.fp8, "layers": converted, "mfu": MFU_BASIS}

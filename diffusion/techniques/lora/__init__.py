"""LoRA as a technique: its settings, its checks against the family (``Family.LORA_TARGETS``) and the rest of the
run, its install and its results entry; the adapters' machinery (PEFT, the base's record, export) is in
diffusion/techniques/lora/adapters.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from diffusion.errors import UsageError, spell
from diffusion.settings import ENCODER_DTYPES, POSITIVE, POSITIVE_INT, SHARE, OneOf, setting, torch_dtype
from diffusion.techniques.technique import Technique

LORA_INITS = ("gaussian", "kaiming")  # PEFT's init_lora_weights: A ~ N(0, 1/rank) or Kaiming-uniform; B = 0 in both


@dataclass
class LoraSettings:
    """LoRA (diffusion/techniques/lora/adapters.py, through PEFT), for families that name their adapter targets (every
    text-to-image family)."""

    lora_rank: Optional[int] = setting(
        None,
        "LoRA: train low-rank adapters of this rank on the denoiser's layers instead of its weights (the base stays "
        "frozen; checkpoints hold the adapters, their optimizer state and EMA; export writes them for diffusers' "
        "load_lora_weights)",
        POSITIVE_INT,
        shown="off",
    )
    lora_alpha: Optional[float] = setting(
        None, "LoRA's scale: the adapters' output is multiplied by alpha / rank", POSITIVE, shown="the rank"
    )
    lora_dropout: float = setting(0.0, "dropout on the adapters' input while training", SHARE)
    lora_targets: Optional[str] = setting(
        None,
        "comma list of the denoiser's layers that get adapters: module names or their endings (to_q, attn.to_out.0)",
        shown="per family: SD the attention projections; SDXL and FLUX also the feed-forward layers",
    )
    lora_init: str = setting("gaussian", "how the adapters' A matrices start (B starts at 0)", OneOf(LORA_INITS))
    lora_text_encoder: bool = setting(
        False,
        "adapters of the same rank on the CLIP text encoders' attention projections too (q_proj, k_proj, v_proj, "
        "out_proj; FLUX's T5 stays frozen), trained with the denoiser's and saved and exported with them; the text "
        "is then encoded each step (no precomputed text embeddings)",
    )
    lora_base_dtype: str = setting(
        "fp32",
        "dtype of the frozen denoiser's weights while its adapters train: bf16 or fp16 halves the base's memory and "
        "the denoiser computes in it, the adapters staying fp32 (one-rank and DDP runs; export and sampling read the "
        "base as its folder stores it)",
        OneOf(ENCODER_DTYPES),
    )


class Lora(Technique):
    NAME = "lora"
    SETTINGS = LoraSettings
    SWITCH = "lora_rank"
    UNSWITCHED = "{given} is a LoRA setting; give {switch} too (e.g. 16), or drop it"

    @classmethod
    def check(cls, cfg, family: type, denoiser_config: dict) -> None:
        if getattr(family, "LORA_TARGETS", None) is None:
            raise UsageError(
                f"{spell('lora_rank')}: {cfg.model_name} is {family.DESCRIPTION}; LoRA adapts the denoiser of a "
                "text-to-image model (SD, SDXL, FLUX, FLUX.2, SD3, Qwen-Image, Z-Image)"
            )
        _check_peft(cfg, family, denoiser_config)
        if cfg.optimizer == "muon":
            raise UsageError(
                f"{spell('optimizer', 'muon')} with {spell('lora_rank')}: Muon orthogonalises whole weight matrices, "
                "and LoRA's low-rank factors are not; use optimizer=adamw"
            )
        if cfg.lora_text_encoder and not getattr(family, "LORA_TEXT_ENCODERS", ()):
            raise UsageError(
                f"{spell('lora_text_encoder', 'true')}: {cfg.model_name} is {family.DESCRIPTION}, whose pipeline reads "
                f"no text encoder adapters (its load_lora_weights takes the denoiser's only); drop "
                f"{spell('lora_text_encoder')}"
            )
        if cfg.lora_text_encoder and cfg.precomputed_latents:
            raise UsageError(
                f"{spell('lora_text_encoder', 'true')} trains adapters on the text encoder, and "
                f"{spell('precomputed_latents', 'true')} batches carry its outputs, computed without them; train on "
                f"the image shards ({spell('precomputed_latents', 'false')}) or drop {spell('lora_text_encoder')}"
            )
        if cfg.lora_base_dtype != "fp32" and cfg.fsdp:
            raise UsageError(
                f"{spell('lora_base_dtype', cfg.lora_base_dtype)} with {spell('fsdp', 'true')}: FSDP2 (torch 2.7) "
                "shards one dtype per unit, and under FSDP each rank holds 1/N of the base already; drop one of them"
            )
        if cfg.lora_targets and not any(t.strip() for t in str(cfg.lora_targets).split(",")):
            raise UsageError(
                f"{spell('lora_targets', cfg.lora_targets)} names no layer; give a comma list such as to_q,to_v"
            )

    @classmethod
    def build_options(cls, cfg) -> dict:
        """The frozen denoiser read in lora_base_dtype (no fp32 copy on the way)."""
        return {"denoiser_dtype": torch_dtype(cfg.lora_base_dtype)}

    @classmethod
    def install(cls, cfg, model) -> list:
        from diffusion.techniques.lora.adapters import install_lora, lora_options

        install_lora(model, lora_options(cfg), cfg.model_name)
        return []

    @classmethod
    def rebuild(cls, config: dict, model) -> None:
        """Fresh adapters for the checkpoint's to fill (their record of the base checked as they load), on the base as
        its folder stores it (lora_base_dtype is training's memory saving)."""
        from diffusion.techniques.lora.adapters import install_lora, lora_options

        install_lora(model, {**lora_options(config), "base_dtype": "fp32"}, config["model_name"])

    MERGES = True
    LOADS = "--lora"

    @classmethod
    def export(cls, config: dict, built, out: str, merge: bool, label: str) -> str:
        """The adapters alone, in the format diffusers' load_lora_weights reads (with lora_base.json naming the base);
        with ``merge``, the base with the adapters folded in, as a whole pipeline."""
        from diffusion.techniques.lora.adapters import WEIGHTS, export_adapters, merge_adapters

        if merge:
            merge_adapters(built.model)
            built.model.export(out, built.tokenizers)
            return f"exported {label} with its LoRA adapters merged to {out}"
        export_adapters(built.model, out)
        return f"exported the LoRA adapters of {label} to {out}/{WEIGHTS}"

    @classmethod
    def scale_for_sampling(cls, model, scale: float) -> None:
        if scale != 1.0:
            from diffusion.techniques.lora.adapters import set_scale

            set_scale(model, scale)

    @classmethod
    def pipeline_loader(cls, folder: str):
        from diffusion.techniques.lora.adapters import pipeline_loader

        return pipeline_loader(folder, cls.LOADS)

    @classmethod
    def results(cls, cfg, model) -> dict:
        """The adapters: rank, alpha, targets, the text encoders adapted too, and how many parameters train (share of
        the adapted parts')."""
        from diffusion.techniques.lora.adapters import lora_options, trainable_share

        options = lora_options(cfg)
        targets = options["targets"] or list(model.LORA_TARGETS)
        texts = list(model.trained_text_encoders)
        return {"rank": options["rank"], "alpha": options["alpha"], "targets": targets, "text_encoders": texts,
                **trainable_share(model)}  # fmt: skip


def _check_peft(cfg, family: type, denoiser_config: dict) -> None:
    """The family's denoiser takes adapters through diffusers' PEFT integration (PeftAdapterMixin: add_adapter) and its
    pipeline writes and reads them (save_lora_weights, load_lora_weights); one line where either lacks it."""
    import diffusers

    part = next(iter(family.PARTS))
    denoiser = family.part_class(part, denoiser_config)
    pipeline = getattr(diffusers, family.PIPELINE or "", None)
    lacking = []
    if not hasattr(denoiser, "add_adapter"):
        lacking.append(f"its {part} ({denoiser.__name__}) takes no adapters (diffusers' PeftAdapterMixin)")
    if pipeline is None or not hasattr(pipeline, "save_lora_weights"):
        lacking.append(f"its pipeline ({family.PIPELINE}) saves and loads no LoRA weights")
    if lacking:
        raise UsageError(
            f"{spell('lora_rank')}: {cfg.model_name} is {family.DESCRIPTION}, and {' and '.join(lacking)} in "
            f"diffusers {diffusers.__version__}; train it whole (drop {spell('lora_rank')})"
        )

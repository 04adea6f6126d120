"""REPA (representation alignment) as a technique: its settings, its checks against the blocks the family names
(``Family.alignable_blocks``), the stored features it adds to precomputed batches and their record's check, and its
install; the encoder, the projector and the loss are in diffusion/techniques/repa/alignment.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from diffusion.batch import REPA_FEATURES, REPA_RECORD
from diffusion.errors import UsageError, spell
from diffusion.settings import POSITIVE, POSITIVE_INT, Check, Duration, setting
from diffusion.techniques.routing import block_ranges, config_value
from diffusion.techniques.technique import Technique


def _repa_block_problem(text) -> str | None:
    return None if re.fullmatch(r"[a-z_]+(\.\d+)?", str(text)) else "is not a block such as double.2, mid or up.1"


@dataclass
class RepaSettings:
    """REPA (diffusion/techniques/repa/alignment.py), for families that name their denoiser's blocks (SD, SDXL, FLUX, SD3, Qwen-Image,
    Z-Image)."""

    repa_encoder: Optional[str] = setting(
        None,
        "REPA: a frozen vision encoder whose patch features a denoiser block is aligned with while training: a local "
        "folder or a Hugging Face id in the local cache (Dinov2Model, CLIPVisionModel, SiglipVisionModel, or a "
        "CLIP/SigLIP model's vision tower)",
        shown="off",
    )
    repa_block: Optional[str] = setting(
        None,
        "the aligned block: FLUX double.N or single.N; SD/SDXL down.N, mid or up.N; Z-Image noise_refiner.N or layers.N",
        Check(_repa_block_problem, "a block such as double.2, mid or up.1", ("double.", "7")),
        shown="transformers: a third of the way in; UNets: mid",
    )
    repa_weight: float = setting(
        0.5, "weight of REPA's loss (1 - cosine similarity) beside the diffusion loss", POSITIVE
    )
    repa_until: Optional[str] = setting(
        None, "when REPA's loss stops (it pays most early)", Duration(("ba", "ep", "sp")), shown="the whole run"
    )
    repa_projector_width: Optional[int] = setting(
        None, "hidden width of REPA's 3-layer MLP projector", POSITIVE_INT, shown="4x the encoder's width, at most 2048"
    )


def family_blocks(family: type, config: dict) -> tuple[dict, str | None]:
    """The family's alignable blocks (name -> models.base.Block) and its default, from the trained part's config
    (missing keys: the class's defaults); ({}, None) if it has none."""
    if getattr(family, "alignable_blocks", None) is None:
        return {}, None
    return family.alignable_blocks(config_value(family, config))


def stored(cfg) -> bool:
    """Whether the training batches carry the encoder's stored features (REPA on precomputed latents)."""
    return Repa.on(cfg) and bool(cfg.precomputed_latents)


class Repa(Technique):
    NAME = "repa"
    SETTINGS = RepaSettings
    SWITCH = "repa_encoder"
    UNSWITCHED = (
        "{given} is set but {switch} is not: give the frozen vision encoder to align with (a local Dinov2Model or "
        "CLIPVisionModel folder), or drop it"
    )

    @classmethod
    def check(cls, cfg, family: type, denoiser_config: dict) -> None:
        """The block against the family's alignable blocks and the encoder's config (no weight loaded); fills the
        default block."""
        from diffusion.techniques.repa.alignment import encoder_spec

        blocks, default = family_blocks(family, denoiser_config)
        if not blocks:
            raise UsageError(
                f"{spell('repa_encoder')}: REPA aligns a denoiser's hidden states; {cfg.model_name} is "
                f"{family.DESCRIPTION}, which has none it names for alignment (REPA is for SD, SDXL, FLUX, SD3, "
                "Qwen-Image and Z-Image)"
            )
        cfg.repa_block = cfg.repa_block or default
        if cfg.repa_block not in blocks:
            raise UsageError(
                f"{spell('repa_block', cfg.repa_block)}: {cfg.model_name} has no such block; {block_ranges(blocks)}"
            )
        encoder_spec(cfg.repa_encoder)  # on precomputed latents the loader checks the dataset's record of it

    @classmethod
    def install(cls, cfg, model) -> list:
        from diffusion.models.base import denoiser_of
        from diffusion.techniques.repa.alignment import install_alignment

        part = denoiser_of(model)
        blocks, _ = family_blocks(type(model), dict(part.config))
        return [install_alignment(model, cfg, blocks[cfg.repa_block])]

    @classmethod
    def columns(cls, cfg):
        """On precomputed latents: the encoder's stored patch features, on its own grid for each image size."""
        if not stored(cfg):
            return None
        import torch

        from diffusion.models.base import hw
        from diffusion.techniques.repa.alignment import encoder_spec, feature_shape

        spec = encoder_spec(cfg.repa_encoder)
        return lambda image_size: {REPA_FEATURES: (feature_shape(spec, *hw(image_size)), torch.float32, None)}

    @classmethod
    def check_data(cls, cfg, root: str, where: str, read_document) -> None:
        """The dataset holds the features of the very encoder ``repa_encoder`` names (its config, normalisation and
        weights), as precompute recorded it (``read_document``: data/shards.py's, the record or None)."""
        if not stored(cfg):
            return
        from diffusion.techniques.repa.alignment import encoder_identity, encoder_spec, identity_problem

        recorded = read_document(root, REPA_RECORD, "REPA features record", "precompute the dataset again")
        name = spell("repa_encoder", cfg.repa_encoder)
        if recorded is None:
            raise UsageError(
                f"{spell(where)} {root} holds no REPA features (no {REPA_RECORD}), which {name} on "
                f"{spell('precomputed_latents', 'true')} reads: precompute it with data.py precompute --repa_encoder "
                f"{cfg.repa_encoder}, or train on the image shards ({spell('precomputed_latents', 'false')})"
            )
        problem = identity_problem(recorded, encoder_identity(encoder_spec(cfg.repa_encoder)))
        if problem:
            raise UsageError(
                f"{spell(where)} {root} holds the REPA features of {recorded.get('path')}, not of {name} ({problem}): "
                f"pass {spell('repa_encoder', recorded.get('path'))}, or precompute again with --repa_encoder "
                f"{cfg.repa_encoder}"
            )

    PRECOMPUTE = ("repa_encoder",)

    @classmethod
    def store(cls, given: dict, out: str, read_document, write_document):
        """The encoder's patch features, once OUT is known to hold no other encoder's (or none, when not given);
        the record of the encoder written before any part is."""
        from diffusion.techniques.repa.alignment import StoredFeatures, encoder_identity, encoder_spec, identity_problem

        name = given.get(cls.SWITCH)
        recorded = read_document(out, REPA_RECORD, "REPA features record", "precompute into a new OUT")
        if name is None:
            if recorded is not None:
                raise UsageError(
                    f"OUT {out} holds REPA features of {recorded.get('path')}: pass {spell(cls.SWITCH)} "
                    f"{recorded.get('path')} to finish it, or precompute into a new OUT"
                )
            return None
        spec = encoder_spec(name)
        identity = encoder_identity(spec)
        problem = recorded and identity_problem(recorded, identity)
        if problem:
            raise UsageError(
                f"OUT {out} holds REPA features of another encoder than {spell(cls.SWITCH)} {name} ({problem}); "
                "precompute into a new OUT"
            )
        if recorded is None:
            write_document(out, REPA_RECORD, {"encoder": name, **identity, "stored": "float16"})
        return StoredFeatures(spec, given.get("encoder_dtype"))

    @classmethod
    def training_only(cls) -> tuple[str, ...]:
        from diffusion.techniques.repa.alignment import PROJECTOR

        return (f"{PROJECTOR}.",)

    @classmethod
    def results(cls, cfg, model) -> dict:
        return {
            "encoder": cfg.repa_encoder,
            "block": cfg.repa_block,
            "weight": cfg.repa_weight,
            "until": cfg.repa_until,
        }

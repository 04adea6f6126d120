"""Muon as a technique (``optimizer=muon``): its settings, its check against the family (``Family.MUON_EXCLUDE``:
None where the family names no hidden matrices for it) and the optimizer it trains with; the optimizer itself is
diffusion/techniques/muon/optimizer.py's."""

from __future__ import annotations

from dataclasses import dataclass

from diffusion.errors import UsageError, spell
from diffusion.settings import Range, setting
from diffusion.techniques.technique import Technique, value


@dataclass
class MuonSettings:
    """Muon (diffusion/techniques/muon/optimizer.py) for the denoiser's hidden weight matrices, AdamW for the rest (optimizer=muon)."""

    muon_momentum: float = setting(0.95, "Muon's Nesterov momentum (optimizer=muon)", Range(ge=0, lt=1))


class Muon(Technique):
    NAME = "muon"
    SETTINGS = MuonSettings
    SWITCH = "optimizer"
    RESULTS = False  # the results line's "optimizer" says it
    UNSWITCHED = "{given} is a Muon setting; give {switch} too, or drop it"

    @classmethod
    def on(cls, cfg) -> bool:
        return value(cfg, "optimizer") == "muon"

    @classmethod
    def check_switch(cls, cfg) -> None:
        if not cls.on(cfg) and cfg.muon_momentum != MuonSettings.muon_momentum:
            raise UsageError(cls.UNSWITCHED.format(given=spell("muon_momentum"), switch=spell("optimizer", "muon")))

    @classmethod
    def check(cls, cfg, family: type, denoiser_config: dict) -> None:
        if getattr(family, "MUON_EXCLUDE", None) is None:
            raise UsageError(
                f"{spell('optimizer', 'muon')}: {family.DESCRIPTION} has no hidden weight matrices named for Muon "
                "(SD, SDXL and FLUX do); use optimizer=adamw"
            )

    @classmethod
    def optimizer(cls, cfg, model, on_gpu: bool):
        from diffusion.techniques.muon.optimizer import MuonWithAdamW, split_for_muon

        matrices, others = split_for_muon(model)
        return MuonWithAdamW(matrices, others, cfg.lr, cfg.weight_decay, tuple(cfg.betas), cfg.muon_momentum)

"""Token routing (TREAD) as a technique: its settings, its checks against the family's block stacks
(``Family.ROUTING``), and its install; the hooks themselves are in diffusion/techniques/routing/tokens.py."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Optional

from diffusion.errors import UsageError, spell
from diffusion.settings import Check, Range, setting
from diffusion.techniques.technique import Technique


def _block_problem(text) -> str | None:
    return None if re.fullmatch(r"[a-z_]+\.\d+", str(text)) else "is not a block STACK.N, such as double.1 or single.3"


BLOCK = Check(_block_problem, "a block STACK.N, e.g. double.1 or single.3 (FLUX)", ("double", "single.-1"))


@dataclass
class RoutingSettings:
    """Token routing (TREAD; diffusion/techniques/routing/tokens.py), for families that name their block stacks (FLUX, FLUX.2,
    SD3, Qwen-Image, Z-Image)."""

    routing_share: Optional[float] = setting(
        None,
        "share of each sample's image tokens that skip the routed blocks while training (TREAD); evaluation and "
        "sampling send every token through every block",
        Range(gt=0, lt=1),
        shown="off",
    )
    routing_first: Optional[str] = setting(
        None,
        "the first routed block: STACK.N counted from 0 (FLUX: double.N or single.N; SD3, Qwen-Image: joint.N; "
        "Z-Image: layers.N)",
        BLOCK,
        shown="the second block",
    )
    routing_last: Optional[str] = setting(
        None,
        "the last routed block (the stacks in order: FLUX's double, then single); the routed tokens rejoin after it",
        BLOCK,
        shown="the second-to-last block",
    )


def config_value(family: type, config: dict):
    """A reader of the trained part's config: its key's value there, else the part's class default."""
    defaults = inspect.signature(next(iter(family.PARTS.values())).__init__).parameters
    return lambda key: config[key] if key in config else defaults[key].default


def stack_lengths(family: type, config: dict) -> dict[str, int]:
    """Blocks per routable stack (label -> count) from the trained part's config (no weights built); empty when the
    family offers no routing."""
    get = config_value(family, config)
    return {label: int(get(key)) for label, (_, key) in (getattr(family, "ROUTING", None) or {}).items()}


def block_ranges(names) -> str:
    """'its blocks: double.0, single.0 to single.1': block names (STACK.N, or a lone STACK) by stack, in order."""
    stacks: dict[str, list[str]] = {}
    for name in names:
        stacks.setdefault(name.split(".")[0], []).append(name)
    return "its blocks: " + ", ".join(n[0] if len(n) == 1 else f"{n[0]} to {n[-1]}" for n in stacks.values())


class Routing(Technique):
    NAME = "routing"
    SETTINGS = RoutingSettings
    SWITCH = "routing_share"
    UNSWITCHED = "{given} is set but {switch} is not: give the share of image tokens to route (e.g. 0.5), or drop it"

    @classmethod
    def check(cls, cfg, family: type, denoiser_config: dict) -> None:
        """The span against the family's stacks; fills the default (the second block to the second-to-last)."""
        lengths = stack_lengths(family, denoiser_config)
        if not lengths:
            raise UsageError(
                f"{spell('routing_share')}: token routing needs block stacks it can hook; {cfg.model_name} is "
                f"{family.DESCRIPTION}, which has none to route around (its family names none in ROUTING); routing is "
                "for FLUX, FLUX.2, SD3, Qwen-Image and Z-Image"
            )
        names = [f"{label}.{i}" for label, n in lengths.items() for i in range(n)]
        cfg.routing_first = cfg.routing_first or names[min(1, len(names) - 1)]
        if cfg.routing_first in names:  # the default last block never comes before the first (a 2-block stack)
            cfg.routing_last = cfg.routing_last or names[max(len(names) - 2, names.index(cfg.routing_first))]
        for key in ("routing_first", "routing_last"):
            if getattr(cfg, key) not in names:
                raise UsageError(
                    f"{spell(key, getattr(cfg, key))}: {cfg.model_name} has no such block; {block_ranges(names)}"
                )
        if names.index(cfg.routing_first) > names.index(cfg.routing_last):
            raise UsageError(
                f"{spell('routing_first', cfg.routing_first)} comes after {spell('routing_last', cfg.routing_last)}: "
                "the span runs from the first routed block to the last"
            )

    @classmethod
    def install(cls, cfg, model) -> list:
        from diffusion.techniques.routing.tokens import install_routing

        install_routing(model, cfg.routing_share, cfg.routing_first, cfg.routing_last)
        return []

    @classmethod
    def results(cls, cfg, model) -> dict:
        return {"share": cfg.routing_share, "first": cfg.routing_first, "last": cfg.routing_last}

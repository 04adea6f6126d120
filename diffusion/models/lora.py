"""LoRA (low-rank adaptation; Hu et al., 2021) of a pretrained denoiser, through PEFT, the library diffusers itself
loads adapters with, for any family that names its adapter targets (``LORA_TARGETS``: SD, SDXL, FLUX).

``install_lora`` adds the adapters to the model's trained part (diffusers' ``add_adapter``: PEFT wraps each target
layer and marks only the adapters trainable) and records which base they belong to: a ``lora_base`` child of the
model whose extra state holds the base's ``model_name`` and a fingerprint of its weights. From then on the model's
``state_dict`` leaves out every frozen weight, so a checkpoint (a file or a sharded folder, and the optimizer state
and EMA, which only follow trainable weights) holds the adapters and the record, never a copy of the base; loading
one into a model built on another base is a one-line error. ``export_adapters`` writes the adapters where
``pipeline.load_lora_weights`` reads them (``pytorch_lora_weights.safetensors`` with PEFT's config as metadata, and
``lora_base.json``); ``check_adapter_folder`` and ``check_base`` guard generate.py's ``--lora``.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from diffusion.errors import UsageError, spell
from diffusion.settings import first_changed, nearest

BASE = "lora_base"  # the child module that records the base (its checkpoint key: lora_base._extra_state)
ADAPTER = "default"  # PEFT's adapter name in training and in checkpoints
WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' file name for saved adapters
BASE_FILE = "lora_base.json"  # beside it: the base the adapters were trained on
LORA_KEYS = ("lora_alpha", "lora_dropout", "lora_targets", "lora_init")
PROBES = 8  # values sampled from each base tensor for the fingerprint
TOLERANCE = 2**-7  # relative: the same base loaded in bf16 or fp16 still matches; another base does not


def lora_options(config) -> dict | None:
    """A run's LoRA settings (a TrainConfig or a checkpoint's saved config dict), or None without ``lora_rank``."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    rank = get("lora_rank")
    if rank is None:
        return None
    targets = get("lora_targets")
    return {
        "rank": int(rank),
        "alpha": float(get("lora_alpha") or rank),
        "dropout": float(get("lora_dropout") or 0.0),
        "targets": [t.strip() for t in str(targets).split(",") if t.strip()] if targets else None,
        "init": get("lora_init") or "gaussian",
    }


def check_lora(cfg, family: type) -> None:
    """The LoRA keys against the family and the rest of the run, before a weight is built."""
    if cfg.lora_rank is None:
        given = first_changed(cfg, LORA_KEYS)
        if given:
            raise UsageError(f"{spell(given)} is a LoRA setting; give {spell('lora_rank')} too (e.g. 16), or drop it")
        return
    if getattr(family, "LORA_TARGETS", None) is None:
        raise UsageError(
            f"{spell('lora_rank')}: {cfg.model_name} is {family.DESCRIPTION}; LoRA adapts the denoiser of SD, SDXL "
            "and FLUX models"
        )
    if cfg.optimizer == "muon":
        raise UsageError(
            f"{spell('optimizer', 'muon')} with {spell('lora_rank')}: Muon orthogonalises whole weight matrices, and "
            "LoRA's low-rank factors are not; use optimizer=adamw"
        )
    if lora_options(cfg)["targets"] == []:
        raise UsageError(
            f"{spell('lora_targets', cfg.lora_targets)} names no layer; give a comma list such as to_q,to_v"
        )


def _config(options: dict, targets: list[str]):
    from peft import LoraConfig

    return LoraConfig(
        r=options["rank"],
        lora_alpha=options["alpha"],
        lora_dropout=options["dropout"],
        target_modules=targets,
        init_lora_weights="gaussian" if options["init"] == "gaussian" else True,
    )


def _check_targets(denoiser: torch.nn.Module, targets: list[str], model_name: str) -> None:
    """Each target names at least one of the denoiser's layers that PEFT adapts (Linear or Conv2d), as PEFT matches
    them (the whole name or its ending after a dot); else one line naming it and the nearest layer names."""
    layers = [n for n, m in denoiser.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    endings = {n.split(".", i)[-1] for n in layers for i in range(n.count(".") + 1)}
    for target in targets:
        if target not in endings:
            raise UsageError(
                f"{spell('lora_targets')}: {model_name}'s denoiser has no Linear or Conv2d layer named {target!r} "
                f"(or ending in .{target}){nearest(target, endings)}"
            )


def denoiser_of(model) -> torch.nn.Module:
    """The model's trained part (the first of its family's PARTS)."""
    return getattr(model, next(iter(model.PARTS)))


def fingerprint(denoiser: torch.nn.Module) -> dict:
    """What identifies a base denoiser's weights, cheaply: a hash of its parameters' names and shapes and a few
    values sampled from each, in fp32. Taken before any adapter wraps its layers (install_lora, check_base)."""
    layout, probe = hashlib.sha256(), []
    for name, p in sorted(denoiser.named_parameters()):
        layout.update(f"{name}:{tuple(p.shape)};".encode())
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // PROBES)
        probe += flat[::step][:PROBES].float().tolist()
    return {"layout": layout.hexdigest()[:16], "probe": probe}


def same_base(a: dict, b: dict) -> bool:
    if a.get("layout") != b.get("layout") or len(a.get("probe", ())) != len(b.get("probe", ())):
        return False
    x, y = torch.tensor(a["probe"]), torch.tensor(b["probe"])
    return torch.allclose(x, y, rtol=TOLERANCE, atol=1e-6)


class LoraBase(torch.nn.Module):
    """The base the adapters belong to, as extra state (a checkpoint carries it beside the adapters): loading the
    state of adapters trained on another base raises a UsageError naming both."""

    def __init__(self, model_name: str, record: dict):
        super().__init__()
        self.model_name, self.record = model_name, record

    def get_extra_state(self) -> dict:
        return {"model_name": self.model_name, **self.record}

    def set_extra_state(self, state: dict) -> None:
        if not same_base(state, self.record):
            raise UsageError(
                f"these LoRA adapters were trained on {state.get('model_name')!r} and this model is "
                f"{self.model_name!r}, whose weights differ (fingerprint {state.get('layout')} vs "
                f"{self.record['layout']}); give the base they were trained on as {spell('model_name')}"
            )


def _frozen(module: torch.nn.Module) -> set[str]:
    """Every name of a frozen weight, each name of a tied one too (T5's shared embedding and its encoder's)."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _leave_out_frozen(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: the frozen weights are not saved (the base is rebuilt from model_name)."""
    for name in _frozen(module):
        state_dict.pop(prefix + name, None)


def _frozen_not_missing(module, incompatible) -> None:
    """load_state_dict post-hook: frozen weights absent from a checkpoint are expected, not missing (keys may carry
    a wrapper's prefix, e.g. DDP's module.)."""
    frozen = _frozen(module)
    incompatible.missing_keys[:] = [
        k for k in incompatible.missing_keys if k not in frozen and k.split(".", 1)[-1] not in frozen
    ]


def install_lora(model, options: dict, model_name: str) -> None:
    """Adapters on the model's denoiser (``options``: lora_options), only they trainable; the base's record; the
    frozen weights left out of the model's state from now on; the same adapters on the copy FLOP counting traces
    (a frozen base computes no weight gradients, and the count says so)."""
    denoiser = denoiser_of(model)
    targets = options["targets"] or list(model.LORA_TARGETS)
    _check_targets(denoiser, targets, model_name)
    model.add_module(BASE, LoraBase(model_name, fingerprint(denoiser)))
    config = _config(options, targets)
    denoiser.add_adapter(config, ADAPTER)  # PEFT: wraps the targets, marks only the adapters trainable
    model.register_state_dict_post_hook(_leave_out_frozen)
    model.register_load_state_dict_post_hook(_frozen_not_missing)
    if hasattr(model, "denoiser_techniques"):
        model.denoiser_techniques.append(lambda d: d.add_adapter(_config(options, targets), ADAPTER))


def trainable_share(model) -> dict:
    """The adapters' parameter count and their share of the denoiser's (base and adapters)."""
    denoiser = denoiser_of(model)
    trainable = sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
    total = sum(p.numel() for p in denoiser.parameters())
    return {"trainable_params": trainable, "trainable_share": round(trainable / max(total, 1), 6)}


def export_adapters(model, out: str) -> None:
    """The adapters (as trained, or the EMA's if loaded so) in diffusers' LoRA format, with PEFT's config as the
    file's metadata (rank, alpha, targets), and the base's record beside them."""
    import diffusers
    from peft.utils import get_peft_model_state_dict

    part = next(iter(model.PARTS))
    denoiser = denoiser_of(model)
    pipeline = getattr(diffusers, model.PIPELINE)
    os.makedirs(out, exist_ok=True)
    pipeline.save_lora_weights(
        out,
        **{
            f"{part}_lora_layers": get_peft_model_state_dict(denoiser, adapter_name=ADAPTER),
            f"{part}_lora_adapter_metadata": denoiser.peft_config[ADAPTER].to_dict(),
        },
    )
    with open(os.path.join(out, BASE_FILE), "w") as f:
        json.dump(getattr(model, BASE).get_extra_state(), f)


def merge_adapters(model, scale: float = 1.0) -> None:
    """The adapters folded into the base weights (scaled by ``scale``) and removed: a plain model again."""
    denoiser = denoiser_of(model)
    denoiser.fuse_lora(lora_scale=scale)
    denoiser.unload_lora()


def adapter_file(path: str, flag: str = "--lora") -> str:
    """The adapters' file in a folder: export's pytorch_lora_weights.safetensors, or the folder's one .safetensors
    file (adapters saved by another trainer); else one line saying what the folder lacks."""
    if os.path.isfile(os.path.join(path, WEIGHTS)):
        return WEIGHTS
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
    if len(found) == 1:
        return found[0]
    what = (
        "does not exist"
        if not os.path.isdir(path)
        else f"holds no {WEIGHTS}" + (f" and {len(found)} other .safetensors files" if found else "")
    )
    raise UsageError(
        f"{flag} {path} {what}; pass a folder export.py wrote from a LoRA run (or one holding a single diffusers LoRA "
        ".safetensors file)"
    )


def check_base(path: str, denoiser: torch.nn.Module, base_name: str, flag: str = "--lora") -> None:
    """An adapter folder whose lora_base.json records another base than ``denoiser``: one line. A folder without
    the record (adapters made elsewhere) is taken as it is."""
    record = os.path.join(path, BASE_FILE)
    if not os.path.isfile(record):
        return
    try:
        with open(record) as f:
            theirs = json.load(f)
    except (OSError, ValueError):
        raise UsageError(f"{flag} {path}: {BASE_FILE} is not readable JSON; export the adapters again") from None
    if not same_base(theirs, fingerprint(denoiser)):
        raise UsageError(
            f"{flag} {path}: these adapters were trained on {theirs.get('model_name')!r}, whose weights differ from "
            f"{base_name!r}'s; sample them with the base they were trained on"
        )

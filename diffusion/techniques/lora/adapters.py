"""LoRA (low-rank adaptation; Hu et al., 2021) of a pretrained denoiser, through PEFT, the library diffusers itself
loads adapters with, for any family that names its adapter targets (``LORA_TARGETS``: SD, SDXL, FLUX).

``install_lora`` adds the adapters to the model's trained part (diffusers' ``add_adapter``: PEFT wraps each target
layer and marks only the adapters trainable) and records which base they belong to: a ``lora_base`` child of the
model whose extra state holds the base's ``model_name`` and a fingerprint of its weights. From then on the model's
``state_dict`` leaves out every frozen weight, so a checkpoint (a file or a sharded folder, and the optimizer state
and EMA, which only follow trainable weights) holds the adapters and the record, never a copy of the base; loading
one into a model built on another base is a one-line error. ``export_adapters`` writes the adapters where
``pipeline.load_lora_weights`` reads them (``pytorch_lora_weights.safetensors`` with PEFT's config as metadata, and
``lora_base.json``); ``pipeline_loader`` checks a folder given to generate.py's ``--lora`` (its file, the base it
records, its layers: ``check_base``, ``check_layers``) and loads it with the pipeline's own ``load_lora_weights``.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from diffusion.errors import UsageError, spell
from diffusion.models.base import denoiser_of
from diffusion.settings import nearest, torch_dtype

BASE = "lora_base"  # the child module that records the base (its checkpoint key: lora_base._extra_state)
ADAPTER = "default"  # PEFT's adapter name in training and in checkpoints
WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' file name for saved adapters
BASE_FILE = "lora_base.json"  # beside it: the base the adapters were trained on
# lora_text_encoder: CLIP's attention projections (diffusers' training scripts' --train_text_encoder targets)
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
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
        "text_encoder": bool(get("lora_text_encoder")),
        "base_dtype": get("lora_base_dtype") or "fp32",
    }


def _config(options: dict, targets: list[str] | tuple[str, ...]):
    from peft import LoraConfig

    return LoraConfig(
        r=options["rank"],
        lora_alpha=options["alpha"],
        lora_dropout=options["dropout"],
        target_modules=list(targets),
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


def text_encoders_of(model) -> dict[str, torch.nn.Module]:
    """The text encoders that get adapters with lora_text_encoder (the family's LORA_TEXT_ENCODERS), by part name."""
    return {name: getattr(model, name) for name in model.LORA_TEXT_ENCODERS}


def fingerprint(denoiser: torch.nn.Module, text_encoders: dict[str, torch.nn.Module] | None = None) -> dict:
    """What identifies a base denoiser's weights, cheaply: a hash of its parameters' names and shapes and a few
    values sampled from each, in fp32; with ``text_encoders`` (adapted too), theirs under "text_encoders". Taken
    before any adapter wraps their layers (install_lora, check_base)."""
    record = _fingerprint(denoiser)
    if text_encoders:
        record["text_encoders"] = {name: _fingerprint(part) for name, part in text_encoders.items()}
    return record


def _fingerprint(module: torch.nn.Module) -> dict:
    layout, probe = hashlib.sha256(), []
    for name, p in sorted(module.named_parameters()):
        layout.update(f"{name}:{tuple(p.shape)};".encode())
        if p.is_meta:  # built to be counted (diffusion.bench.step_memory): no values to sample
            continue
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // PROBES)
        probe += flat[::step][:PROBES].float().tolist()
    return {"layout": layout.hexdigest()[:16], "probe": probe}


def same_base(a: dict, b: dict) -> bool:
    """Two records of a base agree on the denoiser, and on each text encoder both recorded."""
    if a.get("layout") != b.get("layout") or len(a.get("probe", ())) != len(b.get("probe", ())):
        return False
    x, y = torch.tensor(a["probe"]), torch.tensor(b["probe"])
    theirs, ours = a.get("text_encoders") or {}, b.get("text_encoders") or {}
    both = theirs.keys() & ours.keys()
    return torch.allclose(x, y, rtol=TOLERANCE, atol=1e-6) and all(same_base(theirs[n], ours[n]) for n in both)


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
    """Adapters on the model's denoiser (``options``: lora_options) and, with its "text_encoder", on the family's
    LORA_TEXT_ENCODERS, only they trainable (fp32); the denoiser's base in "base_dtype"; the base's record; the
    frozen weights left out of the model's state from now on; the same adapters on the copy FLOP counting traces
    (a frozen base computes no weight gradients, and the count says so)."""
    denoiser = denoiser_of(model)
    targets = options["targets"] or list(model.LORA_TARGETS)
    _check_targets(denoiser, targets, model_name)
    texts = text_encoders_of(model) if options["text_encoder"] else {}
    model.add_module(BASE, LoraBase(model_name, fingerprint(denoiser, texts)))
    config = _config(options, targets)
    dtype = torch_dtype(options["base_dtype"])
    if dtype != torch.float32:
        _store_base_in(denoiser, dtype)
    denoiser.add_adapter(config, ADAPTER)  # PEFT: wraps the targets, marks only the adapters trainable
    _adapters_in_fp32(denoiser)
    for name, part in texts.items():
        _adapt_text_encoder(part, options)
        model.trained_text_encoders[name] = lambda m: _adapt_text_encoder(m, options)
    model.register_state_dict_post_hook(_leave_out_frozen)
    model.register_load_state_dict_post_hook(_frozen_not_missing)
    if hasattr(model, "denoiser_techniques"):
        model.denoiser_techniques.append(lambda d: d.add_adapter(_config(options, targets), ADAPTER))


def _adapt_text_encoder(part: torch.nn.Module, options: dict) -> None:
    """Adapters on a text encoder's attention projections (transformers' add_adapter, PEFT under it), in fp32 when
    the frozen encoder runs in bf16 or fp16 (encoder_dtype); PEFT casts each layer's input to the adapters' dtype."""
    part.add_adapter(_config(options, TEXT_TARGETS), adapter_name=ADAPTER)
    _adapters_in_fp32(part)


def _adapters_in_fp32(part: torch.nn.Module) -> None:
    """PEFT makes a layer's adapters in its base's dtype; trained in bf16, AdamW's small updates would vanish."""
    for p in part.parameters():
        if p.requires_grad and p.dtype != torch.float32 and p.device.type != "meta":
            p.data = p.data.float()


def _store_base_in(denoiser: torch.nn.Module, dtype: torch.dtype) -> None:
    """lora_base_dtype: the frozen denoiser's weights in ``dtype`` (half the memory of fp32), and the denoiser
    computing in it: its floating inputs cast to ``dtype`` on the way in (outside autocast, a bf16 layer fails on
    fp32 input; inside, autocast does the same) and its outputs back to fp32 for the loss and the sampler."""
    torch.nn.Module.to(denoiser, dtype)  # (not diffusers' ModelMixin.to, which warns about modules kept in fp32)
    denoiser.register_forward_pre_hook(lambda m, args, kwargs: _cast((args, kwargs), dtype), with_kwargs=True)
    denoiser.register_forward_hook(lambda m, args, out: _cast(out, torch.float32))


def _cast(value, dtype: torch.dtype):
    """``value`` with every floating tensor in it (in tuples, lists, dicts, diffusers' outputs) cast to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if type(value) is dict:  # a caller's (SDXL's added_cond_kwargs, reused each sampling step): a new one
        return {key: _cast(v, dtype) for key, v in value.items()}
    if isinstance(value, dict):  # diffusers' outputs (OrderedDicts with attributes), made for us: set in place
        for key in list(value):
            value[key] = _cast(value[key], dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def adapted_parts(model) -> dict[str, torch.nn.Module]:
    """The parts carrying adapters, by part name: the denoiser, then the text encoders with lora_text_encoder."""
    part = next(iter(model.PARTS))
    return {part: denoiser_of(model), **{n: getattr(model, n) for n in getattr(model, "trained_text_encoders", {})}}


def trainable_share(model) -> dict:
    """The adapters' parameter count and their share of the adapted parts' (base and adapters: the denoiser's, and
    the text encoders' with lora_text_encoder)."""
    parts = adapted_parts(model).values()
    trainable = sum(p.numel() for part in parts for p in part.parameters() if p.requires_grad)
    total = sum(p.numel() for part in parts for p in part.parameters())
    return {"trainable_params": trainable, "trainable_share": round(trainable / max(total, 1), 6)}


def export_adapters(model, out: str) -> None:
    """The adapters (as trained, or the EMA's if loaded so) in diffusers' LoRA format, with PEFT's config as the
    file's metadata (rank, alpha, targets), and the base's record beside them."""
    import diffusers
    from peft.utils import get_peft_model_state_dict

    pipeline = getattr(diffusers, model.PIPELINE)
    os.makedirs(out, exist_ok=True)
    layers = {}
    for name, part in adapted_parts(model).items():
        layers[f"{name}_lora_layers"] = get_peft_model_state_dict(part, adapter_name=ADAPTER)
        layers[f"{name}_lora_adapter_metadata"] = part.peft_config[ADAPTER].to_dict()
    pipeline.save_lora_weights(out, **layers)
    with open(os.path.join(out, BASE_FILE), "w") as f:
        json.dump(getattr(model, BASE).get_extra_state(), f)


def merge_adapters(model, scale: float = 1.0) -> None:
    """The adapters folded into the base weights (scaled by ``scale``) and removed: a plain model again."""
    from diffusers.loaders.lora_base import _remove_text_encoder_monkey_patch, fuse_text_encoder_lora

    denoiser = denoiser_of(model)
    denoiser.fuse_lora(lora_scale=scale)
    denoiser.unload_lora()
    for name in getattr(model, "trained_text_encoders", {}):
        fuse_text_encoder_lora(getattr(model, name), lora_scale=scale, adapter_names=[ADAPTER])
        _remove_text_encoder_monkey_patch(getattr(model, name))  # what diffusers' unload_lora_weights does


def set_scale(model, scale: float) -> None:
    """The adapters (denoiser's and text encoders') acting at ``scale`` (0: the base alone)."""
    from diffusers.utils.peft_utils import set_weights_and_activate_adapters

    for part in adapted_parts(model).values():
        set_weights_and_activate_adapters(part, [ADAPTER], [scale])


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


def check_base(
    path: str,
    denoiser: torch.nn.Module,
    base_name: str,
    flag: str = "--lora",
    text_encoders: dict[str, torch.nn.Module] | None = None,
) -> None:
    """An adapter folder whose lora_base.json records another base than ``denoiser`` (and ``text_encoders``, those of
    them it recorded): one line. A folder without the record (adapters made elsewhere) is taken as it is."""
    record = os.path.join(path, BASE_FILE)
    if not os.path.isfile(record):
        return
    try:
        with open(record) as f:
            theirs = json.load(f)
    except (OSError, ValueError):
        raise UsageError(f"{flag} {path}: {BASE_FILE} is not readable JSON; export the adapters again") from None
    recorded = theirs.get("text_encoders") or {}
    ours = {n: m for n, m in (text_encoders or {}).items() if n in recorded}
    if not same_base(theirs, fingerprint(denoiser, ours)):
        raise UsageError(
            f"{flag} {path}: these adapters were trained on {theirs.get('model_name')!r}, whose weights differ from "
            f"{base_name!r}'s; sample them with the base they were trained on"
        )


def check_layers(
    path: str, weight_name: str, denoiser: torch.nn.Module, part: str, base_name: str, flag: str = "--lora"
):
    """Adapters in diffusers' format (``{part}.LAYER.lora_A/B...``) for layers the base's denoiser lacks: one line.
    diffusers loads the layers both have and drops the rest with a warning, so a FLUX.2 adapter on a FLUX.1 base
    (their double-stream attention layers share names) would sample as a half-adapted model."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, weight_name), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    keys = list(shapes)
    layers = {k[len(part) + 1 :].split(".lora_")[0] for k in keys if k.startswith(part + ".") and ".lora_" in k}
    modules = dict(denoiser.named_modules())
    missing = sorted(layers - set(modules))
    if missing:
        more = f" and {len(missing) - 2} more" if len(missing) > 2 else ""
        raise UsageError(
            f"{flag} {path}: these adapters are for layers {base_name!r}'s {part} does not have "
            f"({', '.join(missing[:2])}{more}): they were made for another model family (e.g. a FLUX.2 adapter on a "
            "FLUX.1 base); sample them with the base they were trained on"
        )
    # the same layers at other widths (a FLUX.2 [klein] adapter on a [dev] base): diffusers would stop on a size mismatch
    for key, shape in shapes.items():
        layer, kind = key[len(part) + 1 :].split(".lora_")[0], key.rsplit(".", 2)[-2]
        module = modules.get(layer)
        wants = {"lora_A": (1, "in_features"), "lora_B": (0, "out_features")}.get(kind)
        if module is None or wants is None or not hasattr(module, wants[1]) or len(shape) != 2:
            continue
        if shape[wants[0]] != getattr(module, wants[1]):
            raise UsageError(
                f"{flag} {path}: these adapters are for a {part} of other widths than {base_name!r}'s ({layer}: "
                f"{wants[1]} {shape[wants[0]]}, the base's {getattr(module, wants[1])}): they were made for another "
                "model (e.g. a FLUX.2 [klein] adapter on a [dev] base); sample them with the base they were trained on"
            )


def pipeline_loader(folder: str, flag: str = "--lora"):
    """The adapters' file in ``folder`` (adapter_file: a .safetensors file, never a pickle) checked whole (a file that
    is not safetensors, a pickle named so, is one line, as diffusers would only say "Unable to load weights"); then
    the function (pipe, source, scale) that loads them into a pipeline read from ``source``."""
    from diffusion.file_checks import safetensors_problem

    name = adapter_file(folder, flag)
    problem = safetensors_problem(os.path.join(folder, name))
    if problem:
        raise UsageError(f"{flag} {folder}: {name} is {problem}; export the adapters again (export.py)")
    return lambda pipe, source, scale: _load_into(pipe, source, folder, name, scale)


def _load_into(pipe, source: str, folder: str, weight_name: str, scale: float) -> None:
    """diffusers' own load_lora_weights, after the folder and the base it records are checked against the pipeline's."""
    from diffusers.utils import logging as diffusers_logging

    part = "transformer" if getattr(pipe, "transformer", None) is not None else "unet"
    denoiser = getattr(pipe, part)
    texts = {n: getattr(pipe, n) for n in ("text_encoder", "text_encoder_2") if getattr(pipe, n, None) is not None}
    check_base(folder, denoiser, source, text_encoders=texts)
    check_layers(folder, weight_name, denoiser, part, source)
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # "No LoRA keys associated to CLIPTextModel": none were trained, rightly
    try:
        pipe.load_lora_weights(folder, weight_name=weight_name, adapter_name="lora")
    finally:
        diffusers_logging.set_verbosity(level)
    pipe.set_adapters(["lora"], adapter_weights=[scale])

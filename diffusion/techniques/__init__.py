"""Training techniques as plug-ins: each is one module here holding one ``Technique`` subclass (a package where it
has machinery of its own: its ``__init__`` the face, the machinery beside it), and one entry in ``TECHNIQUES``. The trainer, config.py, the data loaders and the results line loop over the registry and never
name a technique; a family never imports one: it declares what it offers (its blocks, its adapter targets, the
matrices Muon may take) as class attributes (models/base.py), and a technique reads them.

A technique's shape, every part optional but its settings:

- ``SETTINGS``: its section of TrainConfig, declared like config.py's (flags, help, docs and validation come from
  it); ``SWITCH`` the key that turns it on. config.py composes TrainConfig from its own sections and these.
- ``check(cfg, family, denoiser_config)``: before any weight is built (the family's class and the trained part's
  config as its folder or preset gives it); may fill a default that depends on the model (routing's span).
- ``build_options(cfg)``: what it asks of build_model (LoRA: the dtype its frozen base is read in).
- ``install(cfg, model)``: on the built model, before the attention backend, activation checkpointing and
  compilation; returns the Composer algorithms it adds (REPA's loss) or none.
- ``optimizer(cfg, model, on_gpu)``: the optimizer it trains with (Muon), else None.
- ``columns(cfg)``: what it adds to each precomputed training batch, for the loaders: a function of the image size
  -> {batch key: (shape, dtype, None)}; ``check_data(cfg, root, where, read_document)``: that a dataset holds them.
- ``PRECOMPUTE`` and ``store(given, out, read_document, write_document)``: its keys data.py precompute takes and what
  it then stores beside the latents (REPA: the encoder's patch features and OUT's record of the encoder).
- ``training_only()`` and ``rebuild(config, model)``: how a trained model is read back for export, sampling and
  evaluation (REPA's projector left out; LoRA's adapters reinstalled).
- ``export(config, built, out, merge, label)``, ``MERGES``: export.py for a model trained with it (LoRA: its
  adapters alone, or with --merge folded in); ``scale_for_sampling(model, scale)``: sampling a checkpoint of it at
  --lora_scale; ``LOADS`` and ``pipeline_loader(folder)``: the sampling flag whose folder (an export of it) it
  loads into a pipeline (LoRA: --lora). Entry points and eval/ reach a technique's machinery only through these.
- ``results(cfg, model)``: its entry on the results line (key ``NAME``), when on.

The modules here import only the standard library and the project's lowest layers at the top: config.py reads
their sections before the installed stack is checked (an entry point refuses a bad setting before torch is
imported). Their machinery (torch modules, Composer algorithms, PEFT) lives in the implementation module each
names, imported inside the hook that uses it.
"""

from __future__ import annotations

from diffusion.techniques.fp8 import Fp8
from diffusion.techniques.grad_clip import GradClip
from diffusion.techniques.lora import Lora
from diffusion.techniques.muon import Muon
from diffusion.techniques.repa import Repa
from diffusion.techniques.routing import Routing
from diffusion.techniques.technique import Technique

# In the order they install: LoRA first (what follows sees the wrapped layers), then token routing, then REPA (its
# hook on a block also sees a routed span's kept tokens), FP8 last (it swaps the blocks' linears in place); their
# sections in this order in TrainConfig.
TECHNIQUES: tuple[type[Technique], ...] = (Lora, Routing, Repa, Muon, GradClip, Fp8)
SECTIONS = tuple(t.SETTINGS for t in TECHNIQUES)


def active(cfg) -> list[type[Technique]]:
    """The techniques a run's config turns on, in registry order."""
    return [t for t in TECHNIQUES if t.on(cfg)]


def exporting(flag: str) -> type[Technique]:
    """The technique whose exports the sampling flag ``flag`` loads into a pipeline (--lora: LoRA's)."""
    return next(t for t in TECHNIQUES if t.LOADS == flag)

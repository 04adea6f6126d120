"""The shape every training technique has (diffusion/techniques/__init__.py says how the parts are used)."""

from __future__ import annotations

from dataclasses import fields

from diffusion.errors import UsageError, spell
from diffusion.settings import first_changed


def value(cfg, key: str):
    """A key's value in a run's TrainConfig or in a checkpoint's saved config (a dict)."""
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


class Technique:
    """A training technique: its settings section and the hooks the trainer calls. Classmethods only: a technique
    holds no state of its own (what it installs on a model or a Trainer does)."""

    NAME: str  # its name, and its key on the results line
    RESULTS = True  # whether the results line has its entry (None while off); Muon's is the line's "optimizer"
    SETTINGS: type  # its section of TrainConfig (settings declared like config.py's)
    SWITCH: str  # the key that turns it on (off while it is None or False)
    # the one line for a key of the section given without SWITCH ({given}, {switch}: the keys as the entry point spells
    # them)
    UNSWITCHED: str = "{given} is set but {switch} is not: set {switch} too, or drop it"
    PRECOMPUTE: tuple[str, ...] = ()  # its keys data.py precompute takes, for what it stores beside the latents

    @classmethod
    def on(cls, cfg) -> bool:
        """Whether a run's config (or a checkpoint's saved one, a dict) turns it on."""
        return value(cfg, cls.SWITCH) not in (None, False)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls.SETTINGS))

    @classmethod
    def check_switch(cls, cfg) -> None:
        """A key of the section changed from its default while the technique is off: one line, before anything."""
        if not cls.on(cfg):
            given = first_changed(cfg, [k for k in cls.keys() if k != cls.SWITCH])
            if given:
                raise UsageError(cls.UNSWITCHED.format(given=spell(given), switch=spell(cls.SWITCH)))

    @classmethod
    def check(cls, cfg, family: type, denoiser_config: dict) -> None:
        """Its keys against the family's offer and the rest of the run, before any weight is built (on only)."""

    @classmethod
    def build_options(cls, cfg) -> dict:
        """What it asks of build_model (on only): keyword arguments, e.g. the dtype the frozen denoiser is read in."""
        return {}

    @classmethod
    def install(cls, cfg, model) -> list:
        """Put it on the built model (on only); the Composer algorithms it adds."""
        return []

    @classmethod
    def optimizer(cls, cfg, model, on_gpu: bool):
        """The optimizer it trains with, or None (on only)."""
        return None

    @classmethod
    def columns(cls, cfg):
        """image size -> {batch key: (shape, dtype, None)} it adds to precomputed training batches, or None."""
        return None

    @classmethod
    def check_data(cls, cfg, root: str, where: str, read_document) -> None:
        """That the precomputed dataset at ``root`` (named by key ``where``) holds what ``columns`` adds
        (``read_document(root, name, what, fix)``: a JSON document beside its index, None where there is none;
        data/shards.py's)."""

    @classmethod
    def store(cls, given: dict, out: str, read_document, write_document):
        """What it stores beside precomputed latents (data.py precompute), or None: ``given`` holds its
        ``PRECOMPUTE`` keys' values and ``encoder_dtype``. First it checks the record it keeps in OUT
        (``read_document(root, name, what, fix)``, ``write_document(root, name, document)``: data/shards.py's; the
        writer does nothing on ranks but 0), so that a re-run into OUT cannot mix two kinds. The store has
        ``columns(image_size)`` -> {column: (shape, numpy dtype name)}, ``rows(images)`` -> {column: one array per
        image} for a batch of [-1, 1] images, and ``to(device)``."""
        return None

    @classmethod
    def training_only(cls) -> tuple[str, ...]:
        """The state-dict prefixes of what it adds to the model for training alone (REPA's projector): left out when
        a trained model is read back for export, sampling and evaluation."""
        return ()

    @classmethod
    def rebuild(cls, config: dict, model) -> None:
        """What a model read back from a checkpoint of a run that used it needs before its weights load (on in the
        run's saved ``config`` only; LoRA: the adapters, on the base as its folder stores it)."""

    @classmethod
    def export(cls, config: dict, built, out: str, merge: bool, label: str) -> str | None:
        """export.py for a model trained with it (on in the run's saved ``config`` only; ``built``: the model read back
        and its tokenizers): the line saying what it wrote to ``out`` (``label``: the model and which weights), or None
        to leave the export to the model (whole). ``merge`` (export.py --merge): fold what it added into the weights
        and export the model whole; a technique that takes ``merge`` says so in MERGES."""
        return None

    MERGES = False  # whether export.py --merge applies to a run that used it

    @classmethod
    def scale_for_sampling(cls, model, scale: float) -> None:
        """A model read back from a checkpoint of a run that used it, about to sample with its additions at ``scale``
        (generate.py --lora_scale; LoRA: the adapters' strength)."""

    LOADS: str | None = None  # the sampling flag whose folder, an export of it, it loads into a pipeline (LoRA: --lora)

    @classmethod
    def pipeline_loader(cls, folder: str):
        """For its LOADS flag: ``folder`` checked (what an export of it holds), then a function (pipe, source, scale)
        that adds it to the pipeline read from ``source``, checked against that base, acting at ``scale``."""
        raise NotImplementedError(f"{cls.NAME} exports nothing a pipeline loads")

    @classmethod
    def results(cls, cfg, model) -> dict | None:
        """Its entry on the results line (on only)."""
        return None

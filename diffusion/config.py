"""The run configuration: one schema for benchmark.py's flags and train.py's yaml recipes.

``TrainConfig`` holds every knob the Trainer builder reads. ``load_config`` reads yaml files and
``key=value`` overrides against it (OmegaConf structured config): an unknown key, a value of the wrong
type or a required value left as ``???`` stops the run before anything starts, naming the key and file.
``validate`` checks combinations that can only be judged once the model and world size are known. The
module imports only the standard library, so entry points take their flag defaults from it before
checking the installed stack.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

from diffusion.aspects import bucket_names_problem
from diffusion.errors import FLAG_NAMES, UsageError, spell
from diffusion.file_checks import check_output_folder
from diffusion.filter_syntax import syntax_error as filter_syntax_error
from diffusion.models.presets import PRESETS  # data, standard library only
from diffusion.recipe_files import check_override, read_recipe
from diffusion.settings import (
    _TIME,
    COUNT,
    ENCODER_DTYPES,
    NEVER,
    POSITIVE,
    POSITIVE_INT,
    SHARE,
    Check,
    Duration,
    Each,
    Either,
    OneOf,
    Range,
    check,
    keys_of,
    nearest,
    read_section,
    setting,
)
from diffusion.techniques import SECTIONS as TECHNIQUE_SECTIONS

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
CROPS = ("center", "random")  # square crops of online images (data/transforms.py)
ATTENTIONS = ("sdpa", "xformers")
SDPA_KERNELS = ("flash", "efficient", "cudnn", "math")  # PyTorch's scaled-dot-product attention kernels
OPTIMIZERS = ("adamw", "muon")


def sdpa_kernels_of(cfg: TrainConfig, model: object) -> str | None:
    """The attention kernels a run trains with: sdpa_kernels, else its family's (None: PyTorch picks among all)."""
    return cfg.sdpa_kernels or getattr(model, "SDPA_KERNELS", None)


def sdpa_kernel_names(text: str) -> list[str]:
    """The kernel names of a sdpa_kernels list ('flash, math' -> ['flash', 'math'])."""
    return [n.strip() for n in str(text).split(",") if n.strip()]


def sdpa_kernels_problem(text: str) -> str | None:
    """What is wrong with a sdpa_kernels list (None: a non-empty comma list of known kernels)."""
    names = sdpa_kernel_names(text)
    if not names or any(n not in SDPA_KERNELS for n in names):
        return f"is not a comma list of {', '.join(SDPA_KERNELS)}"
    return None


def profile_window_of(text) -> tuple[int, int]:
    """(first, count) of a profile window: 'FIRST-LAST' or one batch 'N' (batches count from 1). Not FIRST:COUNT,
    which a yaml recipe would read as a base-60 number (6:3 is 363)."""
    first, _, last = str(text).strip().partition("-")
    first, last = int(first), int(last or first)
    return first, last - first + 1


def profile_window_problem(text) -> str | None:
    """What is wrong with a profile window (None: FIRST-LAST or N, batches from 1, LAST >= FIRST)."""
    try:
        first, count = profile_window_of(text)
    except ValueError:
        return "is not FIRST-LAST (the first and last batch to profile, from 1; e.g. 6-8) or one batch N"
    return None if first > 0 and count > 0 else "must be FIRST-LAST with 1 <= FIRST <= LAST (batches count from 1)"


PROGRESS = ("auto", "bar", "lines", "metrics")  # what a run shows while it works (diffusion/progress.py)
# TrainConfig keys that swap a model part, or a tokenizer, for a local directory
LOCAL_PARTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
LOCAL_TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")
INTERVAL = Duration(("ba", "ep", "sp", "dur"))
OPTIONAL_INTERVAL = Duration(("ba", "ep", "sp", "dur"), never=True)  # off by default, and =never says so


_SIZE = re.compile(r"\s*\d+(\.\d+)?\s*([kmgtpezy]b|b)?\s*", re.IGNORECASE)  # Streaming's bytes_to_int


def _byte_size(text) -> str | None:
    return None if _SIZE.fullmatch(str(text)) else "is not a size such as 500gb, 10mb or 1000000 (bytes)"


# The sections of a run. TrainConfig below is all of them in one flat namespace: every key is unique across
# sections, so recipes stay flat (model_name: ..., lr: ...; every recipe and every checkpoint's saved config
# reads as before) and benchmark.py keeps mosaicml/diffusion-benchmark's flat flags (--batch_size, --lr).
@dataclass
class Model:
    model_name: str = setting(
        "sd2-base",
        f"a preset ({', '.join(PRESETS)}), a local diffusers pipeline directory, or a Hugging Face id "
        "(org/name[@revision]) read from the local cache, never downloaded",
    )
    tokenizer: Optional[str] = setting(None, "local tokenizer directory", shown="the model's")
    tokenizer_2: Optional[str] = setting(
        None,
        "local directory of the second tokenizer (SDXL, FLUX, SD3), paired with text_encoder_2",
        shown="the model's",
    )
    tokenizer_3: Optional[str] = setting(
        None, "local directory of the third tokenizer (SD3's T5), paired with text_encoder_3", shown="the model's"
    )
    prediction_type: Optional[str] = setting(
        None, "SD training target", OneOf(("epsilon", "v_prediction")), shown="the model's scheduler's (epsilon)"
    )
    objective: dict = setting(
        {}, "the family's loss options, KEY=VALUE (SD and SDXL, FLUX, autoencoder; docs/settings.md lists them)"
    )
    vae: Optional[str] = setting(
        None,
        "a local directory of the model's VAE class replacing its VAE (e.g. export.py of an autoencoder run): "
        "AutoencoderKL; FLUX.2's AutoencoderKLFlux2, Qwen-Image's AutoencoderKLQwenImage",
    )
    text_encoder: Optional[str] = setting(
        None,
        "a local directory replacing the model's text encoder (pair it with tokenizer=DIR): CLIPTextModel (SD, FLUX; "
        "SD3's and SDXL's with projection), FLUX.2's and Z-Image's Qwen3, Qwen-Image's Qwen2.5-VL",
    )
    text_encoder_2: Optional[str] = setting(
        None,
        "a local directory replacing the model's second text encoder: SDXL's and SD3's CLIPTextModelWithProjection, "
        "FLUX's T5EncoderModel (pair it with tokenizer_2=DIR)",
    )
    text_encoder_3: Optional[str] = setting(
        None, "a local T5EncoderModel directory replacing SD3's T5 (pair it with tokenizer_3=DIR)"
    )
    attention: str = setting(
        "sdpa", "attention kernels: sdpa (PyTorch) or xformers (CUDA, its extra)", OneOf(ATTENTIONS)
    )
    sdpa_kernels: Optional[str] = setting(
        None,
        "the scaled-dot-product attention kernels PyTorch may pick on CUDA, a comma list of flash, efficient, "
        "cudnn, math (with attention=sdpa)",
        Check(sdpa_kernels_problem, "a comma list of flash, efficient, cudnn, math", ("fast",)),
        shown="the family's: flash,efficient,math for FLUX, all for the others",
    )
    gradient_checkpointing: bool = setting(False, "recompute activations in backward (every trainable diffusers model)")
    compile: bool = setting(False, "torch.compile the trainable denoiser in place (the first batches compile)")
    compile_blocks: bool = setting(
        False,
        "with compile: compile each block of the denoiser's block stacks on its own (a transformer's, e.g. FLUX's "
        "double and single blocks) instead of the whole denoiser: one graph per kind of block, far less compiling",
    )
    compile_encoders: bool = setting(
        False,
        "with compile, on images (not precomputed_latents): compile the frozen VAE and text encoders too, which "
        "encode every batch (each part's submodules, as the step calls them), and with channels_last lay out the "
        "VAE's convolutions channels-last",
    )
    compile_cache: Optional[str] = setting(
        None,
        "with compile: a local folder for torch.compile's caches, read at the start when it holds this torch and "
        "device's, written at the end (the next machine of the same kind does not compile again)",
    )
    channels_last: bool = setting(False, "channels-last memory layout for the trainable denoiser's convolutions")
    cudnn_benchmark: bool = setting(
        False,
        "let cuDNN time its convolution algorithms for each new input shape and keep the fastest (CUDA; the first "
        "batch of each shape, e.g. each aspect bucket, is slower)",
    )
    encoder_dtype: Optional[str] = setting(
        None, "dtype of the frozen VAE and text encoders", OneOf(ENCODER_DTYPES), shown="as built (fp32)"
    )
    text_encoders_on_cpu: bool = setting(
        False,
        "precomputed_latents: keep the frozen text encoders, which no training step calls, in host memory instead "
        "of the GPU's (flux-mid's T5-XXL: 9.5 GB in bf16); sampling during the run moves them over for its duration",
    )


@dataclass
class Data:
    use_synth_data: bool = setting(False, "synthetic data shaped for the model (no dataset needed)")
    synthetic_samples: int = setting(100_000, "samples in the synthetic training set", POSITIVE_INT)
    synthetic_buckets: Optional[str] = setting(
        None,
        "synthetic batches over aspect-ratio buckets at image_size, each batch one bucket's shape: all, or e.g. "
        "1x1,2x1,1x2 (throughput per shape in the results line)",
        Check(bucket_names_problem, "all, or a comma list of bucket names (4x3, 1x2, ...)", ("5x5",)),
        shown="square batches",
    )
    remote: Optional[str] = setting(None, "MDS dataset to stream from (s3://, gs://, oci://, a directory)")
    local: str = setting("/tmp/mds-cache/mds-laion-2/", "local cache for remote, or a local MDS dataset on its own")
    prior_remote: Optional[str] = setting(
        None,
        "a second MDS dataset mixed into every training batch at prior_share (prior preservation: the base's own "
        "samples of what a fine-tune or LoRA should not forget, made with generate.py and data.py convert; or "
        "earlier training data to replay)",
        shown="none",
    )
    prior_local: Optional[str] = setting(
        None, "local cache for prior_remote, or a local MDS dataset on its own", shown="none"
    )
    prior_share: Optional[float] = setting(
        None,
        "share of each training batch drawn from the prior dataset (prior_share x batch_size samples, a whole number)",
        Range(gt=0, lt=1),
        shown="0.5 with a prior dataset",
    )
    precomputed_latents: bool = setting(
        False, "batches carry VAE latent moments + text embeddings (data.py precompute); the encoders do not run"
    )
    filters: list[str] = setting(
        [],
        "keep MDS samples whose metadata passes, e.g. pwatermark<=0.5 (repeatable)",
        Each(Check(filter_syntax_error, "COLUMN OP NUMBER (OP: <=, >=, ==, !=, <, >)", ("pwatermark<<0.5",))),
        flag="filter",
    )
    caption_dropout: float = setting(0.0, "probability of the empty caption (classifier-free guidance; images)", SHARE)
    crop: str = setting("center", "square crop of online images", OneOf(CROPS))
    hflip: bool = setting(False, "random left-right flips of online images")
    image_size: Optional[int] = setting(
        None,
        "image side in pixels, a multiple of the VAE factor x the denoiser's downsampling",
        POSITIVE_INT,
        shown="the model's native",
    )
    batch_size: int = setting(2048, "global batch size over all ranks; must divide by the world size", POSITIVE_INT)
    num_workers: int = setting(8, "dataloader workers per rank", COUNT)
    num_canonical_nodes: int = setting(
        1,
        "Streaming's canonical node count, on which alone the sample order depends (not on the nodes, ranks or "
        "workers); keep it for a run's whole life, resumes on other node counts included; a multiple or a divisor of "
        "the node count (multi-node runs on remote data: the node count, so each node reads its own shards)",
        POSITIVE_INT,
    )
    cache_limit: Optional[str] = setting(
        None,
        "most disk the local cache of a remote dataset may take; shards are evicted past it",
        Check(_byte_size, "a size such as 500gb", ("lots",)),
        shown="no limit",
    )
    predownload: Optional[int] = setting(
        None, "samples each rank downloads ahead of training (Streaming)", COUNT, shown="Streaming's (8 x batch)"
    )
    download_timeout: float = setting(60.0, "seconds one shard download may take", Range(gt=0, unit="seconds"))
    download_retry: Optional[int] = setting(
        None,
        "times a failed shard download is tried again",
        COUNT,
        shown="from OBJECT_STORE_RETRY_SECONDS (remote), 2 otherwise",
    )


@dataclass
class Phase:
    """One resolution phase of a run (the ``phases`` key): until when it runs and what it changes."""

    until: Optional[str] = setting(
        None, "the phase ends at this training time, counted from the run's start (required)", Duration(("sp", "ba"))
    )
    image_size: Optional[int] = setting(None, "image side in this phase", POSITIVE_INT, shown="the run's")
    batch_size: Optional[int] = setting(None, "global batch size in this phase", POSITIVE_INT, shown="the run's")
    device_train_microbatch_size: Any = setting(
        None, "samples per forward/backward on each rank", Either(POSITIVE_INT, ("auto",)), shown="the run's"
    )
    remote: Optional[str] = setting(None, "the phase's dataset (remote)", shown="the run's")
    local: Optional[str] = setting(None, "the phase's dataset (local, or the cache of remote)", shown="the run's")


@dataclass
class Optimization:
    optimizer: str = setting(
        "adamw",
        "adamw, or muon: Muon for the denoiser's hidden weight matrices (update RMS matched to AdamW's, so lr "
        "carries over), AdamW for the rest (docs/training.md)",
        OneOf(OPTIMIZERS),
    )
    lr: float = setting(1.0e-4, "learning rate (optimizer=muon scales Muon's update to match AdamW's)", POSITIVE)
    weight_decay: float = setting(0.01, "decoupled weight decay (both optimizers)", Range(ge=0))
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas", Each(Range(ge=0, lt=1), length=2))
    warmup: str = setting("0ba", "linear warmup of the learning rate", Duration(("ba", "ep", "sp", "dur"), zero=True))
    schedule: str = setting(
        "constant",
        "learning rate after warmup: constant, or cosine decay to 0 at max_duration",
        OneOf(("constant", "cosine")),
    )
    max_duration: str = setting("200ba", "run length (with phases: the last phase's until)", Duration())
    phases: list[dict] = setting(
        [],
        "resolution phases in one run, e.g. [{until: 1000000sp, image_size: 256}, {until: 2000000sp, image_size: "
        "512, batch_size: 1024}]: each changes image_size, batch_size, device_train_microbatch_size, remote, "
        "local until its time; the checkpoint at a phase's end starts the next (needs save_folder, autoresume)",
        Each(
            Check(
                lambda item: None if isinstance(item, dict) else "is not a mapping of phase keys", "a mapping", ("5",)
            )
        ),
        recipe_only=True,
        shown="one phase",
    )
    device_train_microbatch_size: Any = setting(
        None,
        "samples per forward/backward on each rank",
        Either(POSITIVE_INT, ("auto",)),
        shown="auto on GPU, the whole per-rank batch on CPU",
    )
    precision: Optional[str] = setting(
        None, "numeric precision", OneOf(PRECISIONS), shown="amp_bf16 on GPU, fp32 on CPU"
    )
    seed: int = setting(17, "random seed", Range(ge=0, lt=2**32, integer=True))
    use_ema: bool = setting(False, "keep an exponential moving average of the trainable weights (used at eval)")
    ema_smoothing: float = setting(0.9999, "EMA decay per update", Range(gt=0, lt=1))
    ema_update_interval: int = setting(1, "batches between EMA updates", POSITIVE_INT)
    nan_guard: bool = setting(True, "stop at the first non-finite loss, before it reaches the weights")


@dataclass
class Parallelism:
    fsdp: bool = setting(False, "shard the trainable model with FSDP2 across ranks (needs >= 2 ranks)")
    fsdp_reshard_after_forward: bool = setting(
        True, "free gathered weights after forward (off: ~SHARD_GRAD_OP, ZeRO-2)"
    )
    dist_timeout: float = setting(
        600.0,
        "seconds a rank waits for the others in a collective (a dead or stopped rank) before the job ends",
        Range(gt=0, unit="seconds"),
    )


@dataclass
class Checkpoints:
    run_name: Optional[str] = setting(None, "run name", shown="with autoresume: the save folder's name")
    save_folder: Optional[str] = setting(None, "where checkpoints go (a directory or s3://...)")
    save_interval: str = setting("1000ba", "checkpoint every", INTERVAL)
    save_num_checkpoints_to_keep: int = setting(-1, "newest checkpoints kept (-1: all)", Range(ge=-1, integer=True))
    load_path: Optional[str] = setting(None, "a checkpoint to start from (a file or s3://...)")
    load_weights_only: bool = setting(False, "fine-tuning: take the weights of load_path, start a fresh run")
    trust_checkpoint: bool = setting(
        False, "unpickle checkpoints with no weights_only restriction: only for files you made"
    )
    autoresume: bool = setting(False, "continue from the newest whole checkpoint in save_folder")
    resume_with_changes: bool = setting(
        False,
        "autoresume a checkpoint whose run had another model, data, batch size, image size, objective or "
        "optimizer (without it, refused in one line naming what differs)",
    )
    save_overwrite: bool = setting(
        False,
        "start over in a save_folder that holds another run's checkpoints: they are deleted once this run has "
        "saved a whole one (never before); without it such a folder is refused",
    )


@dataclass
class Evaluation:
    eval_interval: Optional[str] = setting(
        None,
        "evaluate on the validation set every (SD: MSE; FLUX: the MLPerf validation loss)",
        OPTIONAL_INTERVAL,
        shown=NEVER,
    )
    eval_samples: int = setting(64, "size of the synthetic validation set", POSITIVE_INT)
    eval_remote: Optional[str] = setting(None, "remote MDS validation set")
    eval_local: Optional[str] = setting(None, "local MDS validation set, or the cache of eval_remote")


@dataclass
class Sampling:
    sample_prompts: list[str] = setting([], "prompts sampled during training (repeatable)", flag="sample_prompt")
    sample_interval: Optional[str] = setting(
        None, "sample the prompts every", Duration(("ba", "ep", "sp"), never=True), shown=NEVER
    )
    sample_folder: str = setting("samples", "where the samples are written")
    sample_steps: int = setting(20, "denoising steps per sample", POSITIVE_INT)
    sample_guidance_scale: float = setting(1.0, "classifier-free guidance scale of the samples", Range(ge=0))


@dataclass
class Quality:
    quality_interval: Optional[str] = setting(
        None, "FID and CLIP score every (e.g. 512000sp, MLPerf SD)", OPTIONAL_INTERVAL, shown=NEVER
    )
    quality_prompts: Optional[str] = setting(None, "prompts file: one per line, or a tsv with a 'caption' column")
    quality_num_samples: Optional[int] = setting(None, "the first N prompts", Range(ge=2, integer=True), shown="all")
    quality_inception: Optional[str] = setting(None, "FID Inception v3 weights file")
    quality_clip: Optional[str] = setting(None, "local CLIP directory (Hugging Face layout)")
    quality_reference_images: Optional[str] = setting(None, "FID reference: a folder of images (or reference_stats)")
    quality_reference_stats: Optional[str] = setting(
        None, "FID reference: an .npz with mu and sigma (MLPerf ships one)"
    )
    quality_steps: int = setting(50, "denoising steps per image", POSITIVE_INT)
    quality_guidance_scale: float = setting(8.0, "classifier-free guidance scale", Range(ge=0))
    quality_batch_size: int = setting(8, "images per sampling call, per rank", POSITIVE_INT)
    quality_fid_features: int = setting(2048, "Inception layer of FID (2048 as published)", OneOf((64, 192, 768, 2048)))


@dataclass
class Logging:
    wandb_name: Optional[str] = setting(None, "Weights & Biases run name (logs only when a name or project is given)")
    wandb_project: Optional[str] = setting(None, "Weights & Biases project")
    results: Optional[str] = setting(None, "append one JSON line per run: images/s, MFU, memory, settings, versions")
    tags: dict = setting({}, "extra KEY=VALUE fields for the results line (repeatable)", flag="tag")
    speed_window: int = setting(10, "batches in Composer's SpeedMonitor window", POSITIVE_INT)
    log_interval: str = setting("10ba", "a progress line (or metrics dump) every", Duration(("ba", "ep")))
    progress: str = setting(
        "auto",
        "a progress bar (loss, images/s), plain lines (training: batch, loss, images/s, ETA every log_interval), "
        "Composer's dump of every metric (metrics; elsewhere the lines), or auto: the bar on a terminal, else lines",
        OneOf(PROGRESS),
    )
    tensorboard_dir: Optional[str] = setting(None, "TensorBoard log directory")
    measure_skip_batches: Optional[int] = setting(
        None, "warm-up batches left out of the throughput figure", COUNT, shown="2"
    )
    straggler_threshold: float = setting(
        0.10, "warn naming every rank whose images/s is this share below the median rank's", Range(gt=0, lt=1)
    )
    profile: Optional[str] = setting(
        None,
        "torch.profiler over batches FIRST-LAST (e.g. 6-8; from 1): each rank's trace and a summary "
        "(GPU busy/idle share, top kernels and ops) in profile_folder",
        Check(profile_window_problem, "FIRST-LAST or N, batches from 1", ("0-3", "5-4", "a")),
        shown="off",
    )
    profile_folder: str = setting("profile", "where profile writes its traces and summaries")


SECTIONS = (
    Model,
    Data,
    Optimization,
    *TECHNIQUE_SECTIONS,  # each training technique's own (diffusion/techniques/)
    Parallelism,
    Checkpoints,
    Evaluation,
    Sampling,
    Quality,
    Logging,
)


# Every setting of a run (the sections above, Model's first): benchmark.py's flags, train.py's recipe keys and the
# Trainer builder's input. A dataclass of all the sections (made here from the list: the techniques' sections come
# from their registry), the first section's fields first.
TrainConfig = dataclass(
    type(
        "TrainConfig",
        tuple(reversed(SECTIONS)),
        {"__module__": __name__, "__doc__": "Every setting of a run: one flat namespace of all the sections."},
    )
)


KEYS = keys_of(*SECTIONS)
FLAG_NAMES.update({k.name: k.flag for k in KEYS if k.flag != k.name})


def check_settings(cfg: TrainConfig) -> TrainConfig:
    """Every value checked against its declaration (type, range, choices, time units), in declaration order;
    the first one outside its rule is a UsageError naming the key as the entry point spells it. Values are
    converted in place (yaml's 1e-4 text to a number); returns ``cfg``."""
    check(cfg, *SECTIONS)
    wrong = synthetic_beside_dataset(cfg)
    if wrong:
        raise UsageError(wrong)
    if cfg.phases:
        phase_configs(cfg)
        cfg.max_duration = cfg.phases[-1]["until"]
    _check_schedule_units(cfg)
    return cfg


def _schedule_unit(time: str, max_duration: str) -> str:
    """The unit Composer's schedulers count ``time`` in: epochs become batches, ``dur`` the run's own unit."""
    unit = _TIME.fullmatch(str(time)).group(2)
    if unit == "dur":
        return _schedule_unit(max_duration, max_duration)
    return "ba" if unit == "ep" else unit


def _check_schedule_units(cfg: TrainConfig) -> None:
    """Composer's warmup schedulers take the warmup and the schedule's length in one unit (batches and epochs
    count as one: epochs are converted); a mix fails at the first batch, so it is one line here."""
    if cfg.schedule != "cosine" and not float(_TIME.fullmatch(str(cfg.warmup)).group(1)):
        return  # a constant schedule without warmup has no warmup scheduler
    warmup, length = _schedule_unit(cfg.warmup, cfg.max_duration), _schedule_unit(cfg.max_duration, cfg.max_duration)
    if warmup != length:
        names = {"ba": "batches (ba, or epochs: ep)", "sp": "samples (sp)", "tok": "tokens (tok)"}
        raise UsageError(
            f"{spell('warmup', cfg.warmup)} and {spell('max_duration', cfg.max_duration)} must count in one unit: "
            f"give both in {names[length]} or both in {names[warmup]}; "
            f"e.g. {spell('warmup', '0' + cfg.max_duration.strip()[-2:])}"
        )


def phase_configs(cfg: TrainConfig) -> list[TrainConfig]:
    """Each phase's run: the run's config with the phase's changes, ``max_duration`` its ``until`` and a
    ``phase`` tag on its results line. Untils must grow, in one unit; the phases hand over by checkpoint."""
    phases = [read_section(Phase, item, f"phases[{i}]", "") for i, item in enumerate(cfg.phases)]
    ends = []
    for i, phase in enumerate(phases):
        if phase.until is None:
            raise UsageError(f"{spell(f'phases[{i}].until')} is required: the training time the phase ends at")
        ends.append((int(float(phase.until[:-2])), phase.until[-2:]))
    if len({unit for _, unit in ends}) > 1 or any(a[0] >= b[0] for a, b in zip(ends, ends[1:])):
        raise UsageError(
            f"{spell('phases')}: the untils ({', '.join(p.until for p in phases)}) must grow, all in samples (sp) or "
            "all in batches (ba)"
        )
    warmup = cfg.warmup.strip()
    if not warmup.startswith("0") and not warmup.endswith(ends[0][1]):
        raise UsageError(
            f"{spell('warmup', warmup)} must be in the phases' unit ({ends[0][1]}): the schedule runs over the whole "
            f"run, and Composer's schedulers take warmup and length in one unit"
        )
    if not (cfg.save_folder and cfg.autoresume):
        raise UsageError(
            f"{spell('phases')} need {spell('save_folder')} and {spell('autoresume', 'true')}: each phase starts "
            "from the checkpoint the one before saved at its end (and a restart finds its phase the same way)"
        )
    changes = [{k: v for k, v in vars(p).items() if v is not None and k != "until"} for p in phases]
    return [
        replace(cfg, **change, max_duration=phase.until, phases=[], tags={**cfg.tags, "phase": i})
        for i, (phase, change) in enumerate(zip(phases, changes))
    ]


def _explain(e, where: str, lines: dict[str, int] | None = None) -> UsageError:
    """One line for an OmegaConf error: the key, the file (and the key's line in it: ``lines``), what to do."""
    from omegaconf.errors import MissingMandatoryValue

    key = str(getattr(e, "full_key", None) or getattr(e, "key", None) or "?")
    if (lines or {}).get(key):
        where = f"{where}, line {lines[key]}"
    first = str(e).splitlines()[0]
    if isinstance(e, MissingMandatoryValue):
        return UsageError(f"{where}: '{key}' is required (left as ???); set it in the yaml or pass {key}=VALUE")
    if "not in" in first:  # ConfigKeyError for a key the schema does not have
        return UsageError(f"{where}: unknown key '{key}'{nearest(key.split('.')[0], [k.name for k in KEYS])}")
    declared = next((k for k in KEYS if k.name == key), None)
    allowed = f"; {key} takes {declared.allowed()}" if declared else ""
    return UsageError(f"{where}: key '{key}': {first}{allowed}")


def load_config(paths: list[str], overrides: list[str] = ()) -> TrainConfig:
    """A TrainConfig from yaml files (later ones win) and ``key=value`` overrides (win over all)."""
    from omegaconf import OmegaConf  # here, not at the top: entry points read the schema before check_stack
    from omegaconf.errors import OmegaConfBaseException

    conf = OmegaConf.structured(TrainConfig)
    required: dict[str, str] = {}  # key left as ??? -> the recipe that asks for it
    layers: list[tuple[str, set]] = []  # (where, the keys it sets): for the training data's source
    for path in paths:
        data, lines = read_recipe(path)  # bounded, UTF-8, a mapping, no duplicate key: or one line
        layers.append((path, set(data)))
        try:
            layer = OmegaConf.create(data)
        except OmegaConfBaseException as e:
            raise _explain(e, path, lines) from None
        missing = OmegaConf.missing_keys(layer)
        required = {k: v for k, v in required.items() if k not in layer or k in missing}
        required.update({k: path for k in missing})
        try:
            conf = OmegaConf.merge(conf, layer)
        except OmegaConfBaseException as e:
            raise _explain(e, path, lines) from None
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UsageError(f"override {bad[0]!r} is not key=value (e.g. max_duration=100ba)")
    for override in overrides:
        check_override(override)
    try:
        dotlist = OmegaConf.from_dotlist(list(overrides))
        conf = OmegaConf.merge(conf, dotlist)
    except OmegaConfBaseException as e:
        raise _explain(e, "command line") from None
    required = {k: v for k, v in required.items() if k not in dotlist}
    layers.append(("command line", set(dotlist)))
    if _synthetic_or_dataset(conf, layers):  # synthetic data won: the recipes' dataset is not read
        required = {k: v for k, v in required.items() if k not in DATASET_KEYS}
    if required:  # merging ??? into the schema keeps its default, so required keys are tracked here
        key, path = next(iter(required.items()))
        raise UsageError(f"{path}: '{key}' is required (left as ???); set it in the yaml or pass {key}=VALUE")
    try:
        cfg = OmegaConf.to_object(conf)
    except OmegaConfBaseException as e:
        raise _explain(e, " + ".join(paths) or "config") from None
    cfg.betas = tuple(cfg.betas)
    return check_settings(cfg)


DATASET_KEYS = ("remote", "local")  # the keys that name a run's training data (MDS), against use_synth_data


def _synthetic_or_dataset(conf, layers: list[tuple[str, set]]) -> bool:
    """Whether the run trains on synthetic data, where the recipes (in order) and the command line (last) set
    ``use_synth_data`` and a dataset (``DATASET_KEYS``): the later one wins, as any key does, so
    ``sd-tiny-cpu.yaml local=MDS`` trains on MDS (the recipe's use_synth_data: true is dropped), and
    ``sd2-base-256.yaml use_synth_data=true`` on synthetic data (the recipe's remote and local are dropped). One
    file, or the command line, that sets both use_synth_data=true and a dataset is refused: which it means is
    not clear. A dataset used to lose silently to the recipe's synthetic data (issue 55)."""
    synthetic = [i for i, (_, keys) in enumerate(layers) if "use_synth_data" in keys]
    dataset = [i for i, (_, keys) in enumerate(layers) if keys & set(DATASET_KEYS)]
    if not synthetic or not conf.use_synth_data:
        return False
    if not dataset:
        return True
    last_synthetic, last_dataset = synthetic[-1], dataset[-1]
    if last_synthetic == last_dataset:
        where, keys = layers[last_synthetic]
        named = [k for k in DATASET_KEYS if k in keys]
        raise UsageError(
            f"{where}: {spell('use_synth_data', 'true')} (synthetic data) and {', '.join(map(spell, named))} (a dataset) "
            "both name the training data; keep one"
        )
    if last_dataset > last_synthetic:
        conf.use_synth_data = False
        return False
    for key in DATASET_KEYS:
        setattr(conf, key, getattr(Data, key))
    return True


def synthetic_beside_dataset(cfg: TrainConfig) -> str | None:
    """What is wrong when a run on synthetic data also names a dataset that it would not read (None: nothing)."""
    if not cfg.use_synth_data:
        return None
    named = [k for k in DATASET_KEYS if getattr(cfg, k) not in (None, getattr(Data, k))]
    named += [f"phases[{i}].{k}" for i, p in enumerate(cfg.phases) for k in DATASET_KEYS if p.get(k) is not None]
    if not named:
        return None
    return (
        f"{spell('use_synth_data', 'true')} trains on synthetic data, and {', '.join(map(spell, named))} "
        f"name{'s' if len(named) == 1 else ''} a dataset it would not read; drop one of them"
    )


def local_parts(source, keys: tuple[str, ...] = LOCAL_PARTS) -> dict[str, str]:
    """The LOCAL_PARTS (or ``keys``: LOCAL_TOKENIZERS) that are set, as ``build_model(local_parts=...)`` (or
    ``tokenizers=...``) takes them, from a TrainConfig, a checkpoint's config dict or parsed CLI arguments."""
    get = source.get if isinstance(source, dict) else lambda key: getattr(source, key, None)
    return {part: get(part) for part in keys if get(part)}


def validate(cfg: TrainConfig, *, world_size: int, downsample_factor: int, on_gpu: bool) -> None:
    """Every value against its declaration (check_settings), then the combinations that can only be judged
    with the model's geometry, the world size and the device, each named as the key to change. The model
    family's own rules (its check_config, models/base.py) come after, from the caller (trainer.check_before_build):
    config sits below models."""
    check_settings(cfg)
    _check_shapes(cfg, world_size, downsample_factor, on_gpu)
    _check_prior(cfg)
    _check_text_encoders_on_cpu(cfg)
    _check_device(cfg, world_size, on_gpu)
    _check_outputs(cfg)


def _check_shapes(cfg: TrainConfig, world_size: int, downsample_factor: int, on_gpu: bool) -> None:
    if cfg.image_size is None or cfg.image_size % downsample_factor:
        near = max(downsample_factor, round((cfg.image_size or 0) / downsample_factor) * downsample_factor)
        raise UsageError(
            f"{spell('image_size', cfg.image_size)} must be a positive multiple of {downsample_factor} "
            f"for {cfg.model_name} (VAE factor x the denoiser's own downsampling or patching); try {near}"
        )
    if cfg.batch_size % world_size:
        raise UsageError(_batch_not_divisible(cfg.batch_size, world_size))
    per_rank, mb = cfg.batch_size // world_size, cfg.device_train_microbatch_size
    if mb == "auto" and not on_gpu:
        raise UsageError(
            f"{spell('device_train_microbatch_size', 'auto')} needs a GPU (it searches by catching CUDA "
            "out-of-memory errors); give an integer on CPU"
        )
    if isinstance(mb, int) and mb > per_rank:
        raise UsageError(
            f"{spell('device_train_microbatch_size', mb)} is larger than the per-rank batch {per_rank} "
            f"({spell('batch_size', cfg.batch_size)} / {world_size} ranks); use at most {per_rank} or raise "
            f"{spell('batch_size')}"
        )
    skip, length = cfg.measure_skip_batches, cfg.max_duration.strip()
    if skip is not None and length.endswith("ba") and skip >= float(length[:-2]):
        raise UsageError(
            f"{spell('measure_skip_batches', skip)} leaves no batch of {spell('max_duration', length)} to "
            f"measure (the throughput figure would be empty); skip fewer or run longer"
        )


PRIOR_SHARE = 0.5  # prior_share's default: half of each batch, as DreamBooth's prior loss with weight 1


def prior_share(cfg) -> float:
    return PRIOR_SHARE if getattr(cfg, "prior_share", None) is None else cfg.prior_share


def prior_split(share: float, batch: int) -> tuple[int, int]:
    """Samples of (the run's dataset, the prior) in a global batch, as Streaming's stratified batching counts
    them: int(proportion x batch) each. (Stream.apply_weights divides the proportions by their sum, and
    (1 - share) + share is exactly 1.0 in floating point, so they stay as given.)"""
    return int((1 - share) * batch), int(share * batch)


def _check_text_encoders_on_cpu(cfg: TrainConfig) -> None:
    if cfg.text_encoders_on_cpu and not cfg.precomputed_latents:
        raise UsageError(
            f"{spell('text_encoders_on_cpu', 'true')}: a run on images encodes every caption with them; it is for "
            f"{spell('precomputed_latents', 'true')} runs, or drop it"
        )


def _check_prior(cfg: TrainConfig) -> None:
    if not (cfg.prior_remote or cfg.prior_local):
        if cfg.prior_share is not None:
            raise UsageError(
                f"{spell('prior_share', cfg.prior_share)} is the share of a prior dataset; give "
                f"{spell('prior_local')} (or {spell('prior_remote')}) too, or drop it"
            )
        return
    if cfg.use_synth_data:
        raise UsageError(
            f"{spell('prior_local')}/{spell('prior_remote')} mix a second MDS dataset into the run's, and "
            f"{spell('use_synth_data', 'true')} reads none; train on MDS data (local or remote) or drop the prior"
        )
    share = prior_share(cfg)
    own, prior = prior_split(share, cfg.batch_size)
    if own + prior != cfg.batch_size or not own or not prior:
        fits = [
            k / cfg.batch_size
            for k in range(1, cfg.batch_size)
            if sum(prior_split(k / cfg.batch_size, cfg.batch_size)) == cfg.batch_size
        ]
        near = min(fits, key=lambda f: abs(f - share), default=None)
        raise UsageError(
            f"{spell('prior_share', share)} of {spell('batch_size', cfg.batch_size)} is {share * cfg.batch_size:g} "
            f"samples, and each batch holds a whole number of each dataset's"
            + (f"; try {spell('prior_share', round(near, 6))}" if near else "; raise batch_size")
        )


def _batch_not_divisible(batch: int, world_size: int) -> str:
    """What to do when the global batch does not divide among the ranks (a resume on another number of ranks
    included): the nearest rank counts that keep it, or the nearest batch sizes that divide."""
    ranks = [max(d for d in range(1, world_size) if batch % d == 0)]
    ranks += [d for d in range(world_size + 1, batch + 1) if batch % d == 0][:1]
    sizes = [s for s in (batch // world_size * world_size, (batch // world_size + 1) * world_size) if s]
    return (
        f"{spell('batch_size', batch)} (the global batch) does not divide among {world_size} ranks (each takes "
        f"batch_size / world size samples); run on {' or '.join(map(str, ranks))} ranks to keep it (a resumed run "
        f"then keeps its sample order), or set {' or '.join(spell('batch_size', s) for s in sizes)}"
    )


def _check_device(cfg: TrainConfig, world_size: int, on_gpu: bool) -> None:
    if cfg.precision not in (None, "fp32") and not on_gpu:
        raise UsageError(f"{spell('precision', cfg.precision)} needs a GPU; Composer trains in fp32 on CPU")
    if cfg.attention == "xformers":
        try:
            import xformers.ops  # noqa: F401
        except ImportError:
            raise UsageError(
                f"{spell('attention', 'xformers')}: xformers is not installed; pip install -e '.[xformers]' "
                f"(CUDA only) or use {spell('attention', 'sdpa')}"
            ) from None
        if not on_gpu:
            raise UsageError(f"{spell('attention', 'xformers')} needs a GPU; use {spell('attention', 'sdpa')} on CPU")
    if cfg.fsdp and world_size < 2:
        raise UsageError(
            f"{spell('fsdp', 'true')} needs at least 2 ranks to shard across (world size is 1); launch with "
            "`composer -n N ...` or drop it (a run's sharded checkpoints go on without it: docs/reliability.md)"
        )


def _check_outputs(cfg: TrainConfig) -> None:
    if cfg.load_path and "://" not in cfg.load_path and not os.path.exists(cfg.load_path):
        raise UsageError(
            f"{spell('load_path')} {cfg.load_path!r} does not exist; pass an existing checkpoint file "
            "(e.g. SAVE_FOLDER/latest-rank0.pt) or leave it unset"
        )
    folders = ("sample_folder",) if cfg.sample_interval else ()
    folders += ("profile_folder",) if cfg.profile else ()
    for key in ("save_folder", "tensorboard_dir") + folders:
        if getattr(cfg, key) and "://" not in getattr(cfg, key):
            check_output_folder(getattr(cfg, key), spell(key))
    if cfg.results and "://" not in cfg.results:
        check_output_folder(os.path.dirname(os.path.abspath(cfg.results)), f"the folder of {spell('results')}")
    if cfg.autoresume and not cfg.save_folder:
        raise UsageError(
            f"{spell('autoresume', 'true')} needs {spell('save_folder')} (where the checkpoints to resume from are written)"
        )
    if cfg.save_overwrite and not cfg.save_folder:
        raise UsageError(
            f"{spell('save_overwrite', 'true')} needs {spell('save_folder')} (the folder to start over in)"
        )
    if cfg.save_overwrite and cfg.autoresume:
        raise UsageError(
            f"{spell('save_overwrite', 'true')} starts over in {spell('save_folder')} and {spell('autoresume', 'true')} "
            f"continues the run there: set one of them (with both, a requeued job would start over at every requeue); "
            f"to start over with a recipe that sets autoresume, add {spell('autoresume', 'false')}"
        )
    if cfg.sample_interval and not cfg.sample_prompts:
        raise UsageError(
            f"{spell('sample_interval')} is set but {spell('sample_prompts')} is empty; give prompts to sample"
        )
    if cfg.quality_interval:
        missing = [k for k in ("quality_prompts", "quality_inception", "quality_clip") if not getattr(cfg, k)]
        if missing:
            raise UsageError(
                f"{spell('quality_interval')} is set but {', '.join(map(spell, missing))} "
                f"{'is' if len(missing) == 1 else 'are'} not; FID and CLIP score need a prompts file and local "
                "weights (docs/evaluation.md)"
            )
        if (cfg.quality_reference_images is None) == (cfg.quality_reference_stats is None):
            raise UsageError(
                f"{spell('quality_interval')}: give exactly one of {spell('quality_reference_images')} (a folder) "
                f"or {spell('quality_reference_stats')} (an .npz with mu and sigma)"
            )

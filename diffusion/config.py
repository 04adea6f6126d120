"""The run configuration: one schema for benchmark.py's flags and train.py's yaml recipes.

``TrainConfig`` holds every knob the Trainer builder reads. ``load_config`` reads yaml files and
``key=value`` overrides against it (OmegaConf structured config): an unknown key, a value of the wrong
type or a required value left as ``???`` stops the run before anything starts, naming the key and file.
``validate`` checks combinations that can only be judged once the model and world size are known. The
module imports only the standard library, so entry points take their flag defaults from it before
checking the installed stack.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from diffusion.errors import UsageError

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
ENCODER_DTYPES = ("fp32", "bf16", "fp16")
CROPS = ("center", "random")  # square crops of online images (data/transforms.py)
ATTENTIONS = ("sdpa", "xformers")
PROGRESS = ("auto", "bar", "lines")  # what a run shows while it works (diffusion/progress.py)
LOCAL_PARTS = ("vae", "text_encoder")  # TrainConfig keys that swap a model part for a local directory


@dataclass
class TrainConfig:
    # model
    model_name: str = "sd2-base"
    tokenizer: Optional[str] = None
    prediction_type: Optional[str] = None  # epsilon | v_prediction (default: the model's scheduler)
    objective: dict = field(default_factory=dict)  # loss overrides: FLUX (flux.py) or autoencoder (autoencoder.py)
    # local pretrained parts replacing the model's own (checked to fit its denoiser):
    vae: Optional[str] = None  # an AutoencoderKL directory (e.g. export.py of an autoencoder run)
    text_encoder: Optional[str] = None  # a CLIPTextModel directory (pair it with its tokenizer=DIR)
    attention: str = "sdpa"
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile the trainable denoiser in place (first batches slower while it compiles)
    channels_last: bool = False  # channels-last memory layout for the trainable denoiser's convolutions
    encoder_dtype: Optional[str] = None  # fp32 | bf16 | fp16 for the frozen VAE/text encoder
    # data
    use_synth_data: bool = False
    synthetic_samples: int = 100_000
    remote: Optional[str] = None
    local: str = "/tmp/mds-cache/mds-laion-2/"
    precomputed_latents: bool = False
    filters: list[str] = field(default_factory=list)  # e.g. ["pwatermark<=0.5", "original_width>=512"]
    caption_dropout: float = 0.0  # probability of the empty caption (classifier-free guidance); images only
    crop: str = "center"  # center | random square crop of online images
    hflip: bool = False  # random left-right flips of online images
    image_size: Optional[int] = None  # default: the model's native resolution
    batch_size: int = 2048  # global (validation uses the same per-rank batch)
    num_workers: int = 8
    # validation (FLUX: the MLPerf validation loss)
    eval_interval: Optional[str] = None  # e.g. 262144sp, 500ba; None: no evaluation
    eval_samples: int = 64  # size of the synthetic validation set
    eval_remote: Optional[str] = None
    eval_local: Optional[str] = None
    # optimization
    lr: float = 1.0e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup: str = "0ba"
    schedule: str = "constant"  # constant | cosine (decays to 0 over max_duration after warmup)
    max_duration: str = "200ba"
    device_train_microbatch_size: Any = None  # int, "auto", or None (auto on GPU)
    precision: Optional[str] = None  # default amp_bf16 on GPU, fp32 on CPU
    seed: int = 17
    # algorithms / parallelism
    use_ema: bool = False
    ema_smoothing: float = 0.9999
    ema_update_interval: int = 1  # batches
    fsdp: bool = False
    fsdp_reshard_after_forward: bool = True  # False ~ SHARD_GRAD_OP (ZeRO-2)
    # seconds a rank waits in a collective for the others (a dead or stopped rank) before the job ends
    # (torch's own NCCL default; long enough for a slow checkpoint load or save on shared storage)
    dist_timeout: float = 600.0
    # checkpoints
    run_name: Optional[str] = None  # default with autoresume: the save folder's name (stable across restarts)
    save_folder: Optional[str] = None
    save_interval: str = "1000ba"
    save_num_checkpoints_to_keep: int = -1
    load_path: Optional[str] = None
    load_weights_only: bool = False  # fine-tuning: take the weights, start a fresh run
    # unpickle checkpoints (load_path, autoresume) with no weights_only restriction: only for files you made
    trust_checkpoint: bool = False  # (diffusion/eval/checkpoint.py)
    autoresume: bool = False
    nan_guard: bool = True  # stop at the first non-finite loss, before it reaches the weights
    # logging / outputs
    wandb_name: Optional[str] = None
    wandb_project: Optional[str] = None
    results: Optional[str] = None
    tags: dict = field(default_factory=dict)  # extra fields for the results line
    speed_window: int = 10
    log_interval: str = "10ba"  # console metrics every N batches
    progress: str = (
        "auto"  # auto | bar | lines: a progress bar (loss, images/s) or the periodic lines; auto: bar on a terminal
    )
    tensorboard_dir: Optional[str] = None
    # samples during training (callbacks.ImageLogger), with the EMA weights when kept
    sample_prompts: list[str] = field(default_factory=list)
    sample_interval: Optional[str] = None  # e.g. 1000ba; None: no samples
    sample_folder: str = "samples"
    sample_steps: int = 20
    sample_guidance_scale: float = 1.0
    # FID + CLIP score during training (callbacks.QualityEval, docs/evaluation.md), with the EMA weights when kept
    quality_interval: Optional[str] = None  # e.g. 512000sp (MLPerf SD); None: off
    quality_prompts: Optional[str] = None  # one prompt per line, or a tsv with a 'caption' column (MLPerf's)
    quality_num_samples: Optional[int] = None  # the first N prompts (None: all)
    quality_inception: Optional[str] = None  # FID Inception v3 weights file
    quality_clip: Optional[str] = None  # local CLIP directory, Hugging Face layout
    quality_reference_images: Optional[str] = None  # FID reference: a folder of images, or
    quality_reference_stats: Optional[str] = None  # an .npz with mu and sigma (MLPerf ships one)
    quality_steps: int = 50
    quality_guidance_scale: float = 8.0
    quality_batch_size: int = 8  # images per sampling call, per rank
    quality_fid_features: int = 2048  # Inception layer: 64, 192, 768 or 2048 (FID as published)
    measure_skip_batches: Optional[int] = None  # batches excluded from the throughput figure (warmup)
    straggler_threshold: float = 0.10  # warn about ranks whose images/s is this share below the median rank's


def _nearest(key: str) -> str:
    names = [f.name for f in fields(TrainConfig)]
    close = difflib.get_close_matches(key, names, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _explain(e, where: str) -> UsageError:
    """One line for an OmegaConf error: the key, the file, what to do."""
    from omegaconf.errors import MissingMandatoryValue

    key = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
    first = str(e).splitlines()[0]
    if isinstance(e, MissingMandatoryValue):
        return UsageError(f"{where}: '{key}' is required (left as ???); set it in the yaml or pass {key}=VALUE")
    if "not in" in first:  # ConfigKeyError for a key the schema does not have
        return UsageError(f"{where}: unknown key '{key}'{_nearest(str(key).split('.')[0])}")
    return UsageError(f"{where}: key '{key}': {first}")


def load_config(paths: list[str], overrides: list[str] = ()) -> TrainConfig:
    """A TrainConfig from yaml files (later ones win) and ``key=value`` overrides (win over all)."""
    from omegaconf import OmegaConf  # here, not at the top: entry points read the schema before check_stack
    from omegaconf.errors import OmegaConfBaseException

    conf = OmegaConf.structured(TrainConfig)
    required: dict[str, str] = {}  # key left as ??? -> the recipe that asks for it
    for path in paths:
        if not os.path.isfile(path):
            raise UsageError(f"recipe {path!r} does not exist; see yamls/ for the recipes")
        try:
            layer = OmegaConf.load(path)
        except Exception as e:  # yaml syntax
            raise UsageError(f"{path}: not valid yaml: {str(e).splitlines()[0]}") from None
        missing = OmegaConf.missing_keys(layer)
        required = {k: v for k, v in required.items() if k not in layer or k in missing}
        required.update({k: path for k in missing})
        try:
            conf = OmegaConf.merge(conf, layer)
        except OmegaConfBaseException as e:
            raise _explain(e, path) from None
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UsageError(f"override {bad[0]!r} is not key=value (e.g. max_duration=100ba)")
    try:
        dotlist = OmegaConf.from_dotlist(list(overrides))
        conf = OmegaConf.merge(conf, dotlist)
    except OmegaConfBaseException as e:
        raise _explain(e, "command line") from None
    required = {k: v for k, v in required.items() if k not in dotlist}
    if required:  # merging ??? into the schema keeps its default, so required keys are tracked here
        key, path = next(iter(required.items()))
        raise UsageError(f"{path}: '{key}' is required (left as ???); set it in the yaml or pass {key}=VALUE")
    try:
        cfg = OmegaConf.to_object(conf)
    except OmegaConfBaseException as e:
        raise _explain(e, " + ".join(paths) or "config") from None
    cfg.betas = tuple(cfg.betas)
    return cfg


def local_parts(source) -> dict[str, str]:
    """The LOCAL_PARTS that are set, as ``build_model(local_parts=...)`` takes them, from a TrainConfig, a
    checkpoint's config dict or parsed CLI arguments."""
    get = source.get if isinstance(source, dict) else lambda key: getattr(source, key, None)
    return {part: get(part) for part in LOCAL_PARTS if get(part)}


def encoder_dtype(name: Optional[str]):
    """The torch dtype for an --encoder_dtype name (None: leave the frozen encoders as built)."""
    if name not in (None, *ENCODER_DTYPES):
        raise UsageError(f"--encoder_dtype {name!r} is not one of {', '.join(ENCODER_DTYPES)}")
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(name)


def validate(cfg: TrainConfig, *, world_size: int, downsample_factor: int, on_gpu: bool, family: str = "sd") -> None:
    """Combinations that are impossible, each reported as the flag to change; then the model family's own
    rules (its check_config, models/base.py)."""
    if not cfg.dist_timeout > 0:
        raise UsageError(f"dist_timeout {cfg.dist_timeout!r} must be a positive number of seconds (default 600)")
    if cfg.image_size is None or cfg.image_size <= 0 or cfg.image_size % downsample_factor:
        raise UsageError(
            f"--image_size {cfg.image_size} must be a positive multiple of {downsample_factor} "
            f"for {cfg.model_name} (VAE factor x the denoiser's own downsampling or patching); try "
            f"{max(downsample_factor, round((cfg.image_size or 0) / downsample_factor) * downsample_factor)}"
        )
    if cfg.batch_size <= 0 or cfg.batch_size % world_size:
        raise UsageError(
            f"--batch_size {cfg.batch_size} must be a positive multiple of the world size "
            f"{world_size} (each rank takes batch_size / world_size samples)"
        )
    per_rank = cfg.batch_size // world_size
    mb = cfg.device_train_microbatch_size
    if mb == "auto":
        if not on_gpu:
            raise UsageError(
                "--device_train_microbatch_size auto needs a GPU (it searches by catching CUDA "
                "out-of-memory errors); give an integer on CPU"
            )
    elif mb is not None:
        if not isinstance(mb, int) or mb <= 0:
            raise UsageError(f"--device_train_microbatch_size {mb!r} must be a positive integer or 'auto'")
        if mb > per_rank:
            raise UsageError(
                f"--device_train_microbatch_size {mb} is larger than the per-rank batch "
                f"{per_rank} (--batch_size {cfg.batch_size} / {world_size} ranks); use at most "
                f"{per_rank} or raise --batch_size"
            )
    if cfg.precision is not None and cfg.precision not in PRECISIONS:
        raise UsageError(f"--precision {cfg.precision!r} is not one of {', '.join(PRECISIONS)}")
    if cfg.precision not in (None, "fp32") and not on_gpu:
        raise UsageError(f"--precision {cfg.precision} needs a GPU; Composer trains in fp32 on CPU")
    if cfg.attention not in ATTENTIONS:
        raise UsageError(f"--attention {cfg.attention!r} is not one of {', '.join(ATTENTIONS)}")
    if cfg.attention == "xformers":
        try:
            import xformers.ops  # noqa: F401
        except ImportError:
            raise UsageError(
                "--attention xformers: xformers is not installed; pip install -e '.[xformers]' "
                "(CUDA only) or use --attention sdpa"
            ) from None
        if not on_gpu:
            raise UsageError("--attention xformers needs a GPU; use --attention sdpa on CPU")
    if cfg.fsdp and world_size < 2:
        raise UsageError(
            "--fsdp needs at least 2 ranks to shard across (world size is 1); launch with "
            "`composer -n N benchmark.py ...` or drop --fsdp"
        )
    encoder_dtype(cfg.encoder_dtype)
    if not 0.0 < cfg.ema_smoothing < 1.0:
        raise UsageError(f"ema_smoothing {cfg.ema_smoothing} must be in (0, 1)")
    if cfg.load_path and "://" not in cfg.load_path and not os.path.exists(cfg.load_path):
        raise UsageError(
            f"load_path {cfg.load_path!r} does not exist; pass an existing checkpoint file "
            "(e.g. SAVE_FOLDER/latest-rank0.pt) or leave it unset"
        )
    if cfg.autoresume and not cfg.save_folder:
        raise UsageError("autoresume needs save_folder (where the checkpoints to resume from are written)")
    if cfg.sample_interval and not cfg.sample_prompts:
        raise UsageError("sample_interval is set but sample_prompts is empty; give prompts to sample")
    if cfg.quality_interval:
        missing = [k for k in ("quality_prompts", "quality_inception", "quality_clip") if not getattr(cfg, k)]
        if missing:
            raise UsageError(
                f"quality_interval is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                "not; FID and CLIP score need a prompts file and local weights (docs/evaluation.md)"
            )
        if (cfg.quality_reference_images is None) == (cfg.quality_reference_stats is None):
            raise UsageError(
                "quality_interval: give exactly one of quality_reference_images (a folder) or "
                "quality_reference_stats (an .npz with mu and sigma)"
            )
    if not 0.0 <= cfg.caption_dropout < 1.0:
        raise UsageError(f"--caption_dropout {cfg.caption_dropout} must be in [0, 1)")
    if cfg.crop not in CROPS:
        raise UsageError(f"--crop {cfg.crop!r} is not one of {', '.join(CROPS)}")
    if cfg.schedule not in ("constant", "cosine"):
        raise UsageError(f"schedule {cfg.schedule!r} is not one of constant, cosine")
    if cfg.progress not in PROGRESS:
        raise UsageError(
            f"--progress {cfg.progress!r} is not one of {', '.join(PROGRESS)} "
            "(auto: a bar when stderr is a terminal, the periodic lines otherwise)"
        )
    if cfg.num_workers < 0:
        raise UsageError(f"--num_workers {cfg.num_workers} must be >= 0")
    if not 0.0 < cfg.straggler_threshold < 1.0:
        raise UsageError(
            f"--straggler_threshold {cfg.straggler_threshold} must be in (0, 1): the share below "
            "the median rank's images/s at which a rank is named as slow"
        )
    from diffusion.models.build import FAMILIES  # the model stack, once the generic checks passed

    FAMILIES[family].check_config(cfg)

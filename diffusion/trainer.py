"""The one place a Composer Trainer is assembled, for benchmark.py and training alike.

``build_trainer(cfg)`` reads a ``TrainConfig`` and returns a ready ``composer.Trainer``, in steps that each
have a name: ``check_before_build`` (the model's geometry, the defaults that depend on it, every check that can be made
before a weight is built), the checkpoint pre-checks, ``build_model`` and data loaders,
``optimizer_and_schedule``, ``callbacks``, ``loggers``, then the Trainer call (microbatching, precision,
FSDP2 sharding, checkpointing). ``fit`` is the whole of benchmark.py and train.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import warnings
from typing import Callable

import torch
from composer import Trainer
from composer.callbacks import MemoryMonitor
from composer.core import Time
from composer.optim import ConstantScheduler, ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler
from composer.utils import dist, reproducibility
from composer.utils.parallelism import FSDP2Config

from diffusion.callbacks import compile_cache
from diffusion.callbacks.ema import EMA
from diffusion.callbacks.image_logger import ImageLogger
from diffusion.callbacks.learned_nothing import LearnedNothing
from diffusion.callbacks.nan_guard import NaNGuard
from diffusion.callbacks.peak_flops import PeakSpeedMonitor
from diffusion.callbacks.preemption import Preemption
from diffusion.callbacks.previous_run import PreviousRunDeleted
from diffusion.callbacks.profile_window import ProfileWindow
from diffusion.callbacks.quality_eval import QualityEval
from diffusion.callbacks.results_line import run_settings
from diffusion.callbacks.resume_line import ResumeLine
from diffusion.callbacks.resume_rng import restore_rng_after_dataset_resumption
from diffusion.callbacks.run_config import RunConfig
from diffusion.callbacks.throughput_recorder import ThroughputRecorder
from diffusion.checkpointing.folder import check_unused, checkpoint_saver, resume_point, settings_changed
from diffusion.checkpointing.local import per_node_signal_files, sharded_problem, unsharded, unsharded_name
from diffusion.checkpointing.lock import save_folder_lock
from diffusion.checkpointing.remote import check_remote_checkpoint, sharded_saver_fixes
from diffusion.checkpointing.unpickling import load_checkpoint_file, safe_loading
from diffusion.config import (
    LOCAL_TOKENIZERS,
    TrainConfig,
    local_parts,
    phase_configs,
    profile_window_of,
    sdpa_kernel_names,
    sdpa_kernels_of,
    validate,
)
from diffusion.data import DataSettings, build_eval_dataloader, build_train_dataloader
from diffusion.errors import RankLost, Stopped, UsageError, rank_lost, spell
from diffusion.models.base import Geometry
from diffusion.models.build import FAMILIES, Built, build_model, describe
from diffusion.models.presets import PRESETS
from diffusion.object_store import check_locations
from diffusion.progress import ProgressBar, ProgressLines, wants_bar
from diffusion.settings import torch_dtype
from diffusion.sharding import mark_fsdp_units
from diffusion.techniques import TECHNIQUES, active


def proc_cpu_model() -> str | None:
    """The CPU's name from /proc/cpuinfo ("model name", what py-cpuinfo reports as ``brand_raw`` on Linux), or
    None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def fast_composer_env() -> None:
    """Composer records the CPU's name in every run and checkpoint (``collect_env.get_cpu_model``: py-cpuinfo,
    which starts a Python subprocess to find it, 1.1-1.3 s of every run's start on the 2-core VM,
    docs/performance.md, 2026-11-28). Composer is frozen upstream, so its function is replaced here, the one
    place: the name comes from /proc/cpuinfo, and from py-cpuinfo only where that has none."""
    from composer.utils import collect_env

    if getattr(collect_env.get_cpu_model, "reads_proc", False):
        return
    composers = collect_env.get_cpu_model

    def get_cpu_model() -> str:
        return proc_cpu_model() or composers()

    get_cpu_model.reads_proc = True
    collect_env.get_cpu_model = get_cpu_model


def _trainable_diffusers_models(model: torch.nn.Module):
    from diffusers import ModelMixin

    return [m for m in model.modules() if isinstance(m, ModelMixin) and any(p.requires_grad for p in m.parameters())]


def _frozen_diffusers_models(model: torch.nn.Module):
    from diffusers import ModelMixin

    return [part for name in type(model).FROZEN if isinstance(part := getattr(model, name), ModelMixin)]


def configure_model(model: torch.nn.Module, cfg: TrainConfig) -> list:
    """The run's training techniques in their registry's order (diffusion/techniques/: LoRA's adapters first, what
    follows sees the wrapped layers; token routing before the attention backend, which then reaches its processors
    too), then the attention backend, activation checkpointing and memory layout, applied to every diffusers model
    inside (compilation comes last, in ``compile_model``); and cuDNN's autotuner. The Composer algorithms the
    techniques add (REPA's loss)."""
    algorithms = [algorithm for technique in active(cfg) for algorithm in technique.install(cfg, model)]
    if cfg.attention == "xformers":
        for m in model.modules():
            if hasattr(m, "enable_xformers_memory_efficient_attention") and m is not model:
                m.enable_xformers_memory_efficient_attention()
    kernels = sdpa_kernels_of(cfg, model)
    if kernels is not None:
        allow_sdpa_kernels(kernels)
    if cfg.gradient_checkpointing:
        targets = [m for m in _trainable_diffusers_models(model) if m._supports_gradient_checkpointing]
        if not targets:
            raise UsageError("--gradient_checkpointing: this model has no trainable part that supports it")
        for m in targets:
            m.enable_gradient_checkpointing()
    if cfg.channels_last:
        for m in _trainable_diffusers_models(model):
            m.to(memory_format=torch.channels_last)
        if cfg.compile_encoders:  # the frozen VAE's convolutions too (the text encoders have none)
            for part in _frozen_diffusers_models(model):
                part.to(memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark  # process-wide, as torch keeps it; set either way
    return algorithms


def hold_text_encoders(model) -> None:
    """A precomputed run's text encoders stay in host memory when Composer moves the model to the GPU
    (``Family.held``), and out of DDP's broadcast of the model's state at the start (NCCL moves no host tensor;
    they are frozen and built alike on every rank)."""
    model.held = model.text_encoder_parts()
    for name in model.held:
        getattr(model, name).to("cpu")
    held = [f"{name}.{key}" for name in model.held for key, _ in getattr(model, name).state_dict().items()]
    model._ddp_params_and_buffers_to_ignore = held


def allow_sdpa_kernels(names: str) -> None:
    """Let PyTorch's scaled-dot-product attention pick only among ``names`` (comma list of SDPA_KERNELS), for the
    whole process: torch's global switches, which every attention call (diffusers', transformers') reads."""
    allowed = set(sdpa_kernel_names(names))
    torch.backends.cuda.enable_flash_sdp("flash" in allowed)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in allowed)
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in allowed)
    torch.backends.cuda.enable_math_sdp("math" in allowed)


# Compiled graphs kept per function: one per batch shape (aspect-ratio buckets: up to 15 per resolution)
RECOMPILE_LIMIT = 64


def compile_model(model: torch.nn.Module, cfg: TrainConfig) -> None:
    """torch.compile each trainable diffusers model in place (``Module.compile``: parameter names and
    checkpoints stay as they are; the frozen encoders run eagerly). Static shapes: a new batch shape (a
    bucket, a phase) compiles a graph of its own, where torch's default recompiles once with the sizes made
    dynamic, which on torch 2.7 fails in Inductor on SD's UNet (docs/data.md has the measured costs); the
    recompile limit is raised so that no bucket falls back to eager."""
    if cfg.compile:
        import torch._dynamo.config as dynamo

        name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILE_LIMIT))
        if cfg.compile_cache:
            line = compile_cache.load(cfg.compile_cache)
            if dist.get_global_rank() == 0:
                print(line, flush=True)
        # compile_blocks: each block of the trained part's stacks (the family's BLOCKS) on its own; blocks of one
        # kind share their compiled graph (torch treats a module's parameters as inputs), so a 57-block FLUX
        # compiles two graphs instead of one holding every block
        trained = getattr(model, next(iter(type(model).PARTS)), None) if cfg.compile_blocks else None
        for m in _trainable_diffusers_models(model):
            if m is trained:
                for attr, _ in type(model).BLOCKS.values():
                    for block in getattr(m, attr):
                        block.compile(dynamic=False)
            else:
                m.compile(dynamic=False)
        if cfg.compile_encoders:  # each frozen part's submodules: a step calls vae.encoder, a text encoder's forward
            for name in type(model).FROZEN:
                for child in getattr(model, name).children():
                    child.compile(dynamic=False)


# Known, harmless notices that would otherwise bury the run's own output.
# Our ProgressBar is Composer's own plus images/s; the Trainer warns about any bar passed in `loggers`.
# A checkpoint saved before ResumeLine kept its save time has no state for it: the line leaves the time out.
for _message in (
    "FSDP2 Config/APIs are experimental",
    "Specifying the ProgressBarLogger via `loggers`",
    "ResumeLine is not in the state_dict",
    # a resume on another number of ranks: Composer restores the RNG of the ranks both worlds have; ResumeLine says so
    r"The current world size \(\d+ is (greater|less) than the number of RNG state",
):
    warnings.filterwarnings("ignore", message=_message)


def fit(cfg: TrainConfig | Callable[[], TrainConfig]) -> None:
    """Build, train, close: the whole of benchmark.py and train.py. A collective that failed because another
    rank died, hung or was stopped (after dist_timeout) raises RankLost with one line for the log; a run stopped
    by SIGTERM/SIGUSR1 (callbacks/preemption.py) raises Stopped once its checkpoint is saved; bad input
    (UsageError) and a diverged loss (TrainingDiverged) propagate as they are. diffusion.cli.run reports
    them all and leaves the process group."""
    timeout = TrainConfig.dist_timeout
    try:
        cfg = cfg() if callable(cfg) else cfg
        timeout = cfg.dist_timeout
        runs = phase_configs(cfg) if cfg.phases else [cfg]
        for run in runs[1:]:  # every later phase's settings checked now, not hours from now when it starts
            check_before_build(dataclasses.replace(run))
        trained = False
        with save_folder_lock(cfg.save_folder):  # before anything reads the folder: one run per folder
            check_unused(cfg.save_folder, cfg.autoresume, cfg.save_overwrite)  # another run's checkpoints kept
            for i, run in enumerate(runs):  # one run, or its resolution phases in order
                phase = f"phase {i + 1} of {len(runs)}" if cfg.phases else None
                # autoresume's line: said by the first phase that trains (a later one only takes over its checkpoint)
                trained |= _fit_one(run, schedule_until=cfg.max_duration, phase=phase, announce=not trained)
    except RuntimeError as e:
        lost = rank_lost(e, timeout)
        if lost is None:
            raise
        raise RankLost(lost) from e


def _fit_one(cfg: TrainConfig, schedule_until: str, phase: str | None = None, announce: bool = True) -> bool:
    """Build, train and close one run (or phase); whether it trained. A phase that a resumed checkpoint has
    finished already is closed untrained; a run stopped by a signal raises Stopped once its checkpoint is saved.
    ``phase`` and ``announce``: as build_trainer's."""
    trainer = build_trainer(cfg, schedule_until, phase=phase, announce=announce)
    until = Time.from_timestring(cfg.max_duration)
    trains = trainer.state.timestamp.get(until.unit).value < until.value
    if trains:
        trainer.fit()
    preemption = next(cb for cb in trainer.state.callbacks if isinstance(cb, Preemption))
    trainer.close()
    if preemption.stopped_by is not None:
        raise Stopped(preemption.summary(trainer.state))
    return trains


def build_trainer(
    cfg: TrainConfig, schedule_until: str | None = None, *, phase: str | None = None, announce: bool = True
) -> Trainer:
    """Every checkpoint read while building (load_path, autoresume) unpickles with weights_only=True and only
    the types our checkpoints hold, Composer's own loads included, unless trust_checkpoint. ``schedule_until``:
    where the learning-rate schedule ends (a phase's run: the whole run's end; default its max_duration).
    With autoresume, one line says where the run starts (callbacks/resume_line.py; ``phase``: which phase
    this is, e.g. "phase 2 of 3"; ``announce=False``: not said)."""
    with safe_loading(cfg.trust_checkpoint):
        return _build_trainer(
            cfg, schedule_until or cfg.max_duration, _resume_line(cfg, schedule_until, phase, announce)
        )


def check_before_build(cfg: TrainConfig, *, world_size: int | None = None, on_gpu: bool | None = None) -> Geometry:
    """Everything that can be judged before a weight is built: the model's geometry from its configs, the
    defaults that depend on it (image_size), and the config checked against the model, its family's rules
    and the world (config.validate). Fills ``cfg`` in place; returns the geometry."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    world_size = dist.get_world_size() if world_size is None else world_size
    geometry = describe(cfg.model_name, local_parts=local_parts(cfg))
    if cfg.image_size is None:
        cfg.image_size = geometry.resolution
    validate(cfg, world_size=world_size, downsample_factor=geometry.downsample_factor, on_gpu=on_gpu)
    family = FAMILIES[geometry.family]
    family.check_config(cfg)  # the family's own rules, once the generic checks passed
    for technique in TECHNIQUES:  # a technique's key given without the one that turns it on
        technique.check_switch(cfg)
    for technique in active(cfg):  # against what the family offers; fills their defaults (routing's span)
        technique.check(cfg, family, geometry.denoiser_config)
    check_compile_options(cfg, geometry)
    return geometry


def check_compile_options(cfg: TrainConfig, geometry: Geometry) -> None:
    """compile_blocks, compile_encoders and compile_cache shape a compiled run; compile_blocks needs the family's block
    stacks, compile_encoders a run that calls its encoders (on images)."""
    for key in ("compile_blocks", "compile_encoders", "compile_cache"):
        if getattr(cfg, key) and not cfg.compile:
            raise UsageError(f"{spell(key)} shapes a compiled run: add {spell('compile', 'true')}, or drop it")
    if cfg.compile_encoders and cfg.precomputed_latents:
        raise UsageError(
            f"{spell('compile_encoders', 'true')}: a {spell('precomputed_latents', 'true')} run never calls its "
            "encoders; drop it"
        )
    if cfg.compile_blocks and not FAMILIES[geometry.family].BLOCKS:
        raise UsageError(
            f"{spell('compile_blocks', 'true')}: {cfg.model_name} has no block stacks to compile one by one (a UNet or "
            f"an autoencoder); {spell('compile', 'true')} alone compiles its denoiser whole"
        )


def _check_checkpoints(cfg: TrainConfig, on_gpu: bool) -> str | None:
    """A damaged or hostile load_path is one line now, not Composer's traceback; with autoresume, 'latest'
    points at the newest whole checkpoint (torn ones skipped, rank 0). Without FSDP, a sharded checkpoint folder
    (load_path, or the one autoresume picks) becomes a checkpoint file beside it (checkpointing.local.unsharded, on rank 0
    while the others wait), which Composer then loads. The load_path the Trainer gets."""
    load_path = cfg.load_path
    if load_path and os.path.isdir(load_path):
        _check_sharded_load_path(load_path, cfg)  # with FSDP, Composer's own sharded load reads it next
        if not cfg.fsdp:
            load_path = _unsharded_load_path(load_path, cfg, on_gpu)
    if load_path and os.path.isfile(load_path):
        _check_same_model(load_checkpoint_file(load_path, "load_path", cfg.trust_checkpoint, mmap=True), cfg)
    elif load_path and "://" in load_path:
        check_remote_checkpoint(load_path, "load_path", cfg.trust_checkpoint)
    if cfg.autoresume:
        point = resume_point(cfg.save_folder, cfg.trust_checkpoint, unshard=not cfg.fsdp)
        phased = cfg.phases or "phase" in cfg.tags  # a phase changes its sizes by design
        if point and not phased and not cfg.resume_with_changes:
            _check_same_run(point, cfg)
    return load_path


def _check_same_run(point: str, cfg: TrainConfig) -> None:
    """The checkpoint autoresume found was saved by a run with the settings that define this one: a recipe rerun
    with other overrides (a relative save_folder of a recipe) quietly continued the earlier run, maybe a finished
    one, with the new settings. One line naming what differs, rank 0 (which chose the checkpoint)."""
    changed = settings_changed(point, dataclasses.asdict(cfg), cfg.trust_checkpoint)
    if changed:
        said = ", ".join(f"{spell(k, str(then))} there, {spell(k, str(now))} now" for k, then, now in changed)
        raise UsageError(
            f"autoresume: {spell('save_folder')} {cfg.save_folder} holds a run of other settings ({said}), which "
            f"this run would continue from {os.path.basename(point.rstrip('/'))}; to start over there set "
            f"{spell('save_overwrite', 'true')} {spell('autoresume', 'false')}, give another save_folder, or set "
            f"{spell('resume_with_changes', 'true')} to continue it with these settings"
        )


def _check_sharded_load_path(folder: str, cfg: TrainConfig) -> None:
    """A load_path folder is a whole sharded checkpoint whose ``.metadata`` unpickles safely (a hostile one: the
    one line of a hostile file), on every rank: each reads it in Composer's load."""
    why = sharded_problem(folder, spell("load_path"), cfg.trust_checkpoint)
    if why:
        raise UsageError(
            f"{spell('load_path')} {folder} is a directory but not a whole sharded checkpoint ({why}); pass a "
            "checkpoint file or a sharded checkpoint folder a run saved (SAVE_FOLDER/ep0-ba10)"
        )


def _unsharded_load_path(folder: str, cfg: TrainConfig, on_gpu: bool) -> str:
    if dist.get_world_size() > 1:  # rank 0 writes the file, the others wait for it (bounded by dist_timeout)
        dist.initialize_dist("gpu" if on_gpu else "cpu", cfg.dist_timeout)
    path = unsharded(folder, cfg.trust_checkpoint) if dist.get_global_rank() == 0 else None
    dist.barrier()
    return path or unsharded_name(folder)


def _check_same_model(loaded, cfg: TrainConfig) -> None:
    """A load_path that is no training checkpoint, or one saved by a run of another model (its RunConfig's
    model_name): one line now, not a KeyError deep in Composer's load of the weights or optimizer state."""
    state = loaded.get("state") if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise UsageError(
            f"{spell('load_path')} {cfg.load_path} is a torch file but not a training checkpoint (no 'state'); pass a "
            "checkpoint a run saved (SAVE_FOLDER/latest-rank0.pt)"
        )
    theirs = ((state.get("callbacks") or {}).get("RunConfig") or {}).get("config", {}).get("model_name")
    if theirs and theirs != cfg.model_name:
        raise UsageError(
            f"{spell('load_path')} {cfg.load_path} was saved by a {spell('model_name', theirs)} run and this run trains "
            f"{spell('model_name', cfg.model_name)}: its weights and optimizer state do not fit; give this run's "
            f"{spell('model_name')}, or a checkpoint of {cfg.model_name}"
        )


def optimizer_and_schedule(cfg: TrainConfig, model: torch.nn.Module, on_gpu: bool, schedule_until: str | None = None):
    """A technique's optimizer (optimizer=muon: Muon + AdamW), else AdamW over the trainable parameters (fused on
    GPU), and the warmup + constant/cosine schedule (cosine decays to 0 at ``schedule_until``, the run's end; a
    phase's max_duration is only its own end)."""
    chosen = (technique.optimizer(cfg, model, on_gpu) for technique in active(cfg))
    optimizer = next((found for found in chosen if found is not None), None)
    if optimizer is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            trainable,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
            fused=on_gpu,
            foreach=None if on_gpu else True,
        )
    warmup = Time.from_timestring(cfg.warmup)
    if cfg.schedule == "cosine":
        scheduler = CosineAnnealingWithWarmupScheduler(
            t_warmup=warmup, t_max=schedule_until or cfg.max_duration, alpha_f=0.0
        )
    else:
        scheduler = ConstantWithWarmupScheduler(t_warmup=warmup) if warmup.value else ConstantScheduler()
    return optimizer, scheduler


def _resume_line(cfg: TrainConfig, schedule_until: str | None, phase: str | None, announce: bool) -> ResumeLine | None:
    """With a save folder, the callback that keeps each checkpoint's save time and, with autoresume, says where
    the run starts; None without one."""
    if not cfg.save_folder:
        return None
    final = schedule_until is None or Time.from_timestring(schedule_until) == Time.from_timestring(cfg.max_duration)
    return ResumeLine(cfg.save_folder, cfg.load_path, cfg.batch_size, phase, final, announce and cfg.autoresume)


def callbacks(
    cfg: TrainConfig, built: Built, flops: dict[str, float], on_gpu: bool, resume: ResumeLine | None = None
) -> list:
    """The run's callbacks, in the order they must run: EMA first (it updates before anything reads the
    weights at the end of a batch), the checkpoint saver last (after Preemption, which may stop the run at
    that batch: the saver then saves it as the run's end). ``resume``: the run's ResumeLine, if any."""
    skip = cfg.measure_skip_batches
    out = [EMA(cfg.ema_smoothing, cfg.ema_update_interval)] if cfg.use_ema else []
    out += [
        Preemption(),
        PeakSpeedMonitor(window_size=cfg.speed_window),  # MFU against callbacks/peak_flops.py's table
        ThroughputRecorder(
            cfg.results,
            flops,
            run_settings(cfg, built),
            skip_batches=2 if skip is None else skip,
            straggler_threshold=cfg.straggler_threshold,
        ),
        RunConfig(cfg),
    ]
    if cfg.nan_guard:
        out.append(NaNGuard())
    if not cfg.use_synth_data:  # random images have nothing to learn
        out.append(LearnedNothing(from_random_weights=cfg.model_name in PRESETS and not cfg.load_path))
    if cfg.profile:
        out.append(ProfileWindow(*profile_window_of(cfg.profile), cfg.profile_folder))
    if cfg.compile and cfg.compile_cache:
        out.append(compile_cache.CompileCache(cfg.compile_cache))
    out += sampling_callbacks(cfg, built.tokenizers)
    if on_gpu:
        out.append(MemoryMonitor())
    if resume:
        out.append(resume)
    saver = checkpoint_saver(
        cfg.save_folder,
        cfg.save_interval,
        cfg.save_num_checkpoints_to_keep,
        overwrite=_overwrites(cfg),
        sharded=cfg.fsdp,
    )  # saves that cannot tear; the Trainer takes it as its own
    if saver:
        out.append(saver)
    if cfg.save_overwrite:  # after the saver: it sees each save done
        out.append(PreviousRunDeleted(cfg.save_folder))
    return out


def sampling_callbacks(cfg: TrainConfig, tokenizers: dict) -> list:
    """The callbacks that sample the model during the run: its sample images (sample_interval) and FID/CLIP
    (quality_interval)."""
    out = []
    if cfg.sample_interval:
        out.append(
            ImageLogger(
                cfg.sample_prompts,
                cfg.sample_interval,
                cfg.sample_folder,
                tokenizers,
                steps=cfg.sample_steps,
                guidance_scale=cfg.sample_guidance_scale,
                image_size=cfg.image_size,
                seed=cfg.seed,
            )
        )
    if cfg.quality_interval:  # seed left at the callback's default so figures equal evaluate.py's
        out.append(
            QualityEval(
                cfg.quality_prompts,
                cfg.quality_interval,
                tokenizers,
                inception=cfg.quality_inception,
                clip=cfg.quality_clip,
                reference_images=cfg.quality_reference_images,
                reference_stats=cfg.quality_reference_stats,
                num_samples=cfg.quality_num_samples,
                steps=cfg.quality_steps,
                guidance_scale=cfg.quality_guidance_scale,
                image_size=cfg.image_size,
                batch_size=cfg.quality_batch_size,
                fid_features=cfg.quality_fid_features,
            )
        )
    return out


def _overwrites(cfg: TrainConfig) -> bool:
    """Whether the run's saves may write over files in save_folder: a resumed run's leftovers of the killed one
    (newer than 'latest', maybe half written), or the checkpoints of the run save_overwrite starts over from."""
    return cfg.autoresume or cfg.save_overwrite


def loggers(cfg: TrainConfig) -> list:
    """W&B and TensorBoard when asked for (a missing package is one line saying what to install), and what
    the run shows while it works (progress.py): the bar, or our one line per log interval; with
    progress=metrics, Composer's console logger instead (the Trainer's log_to_console)."""
    out = []
    if cfg.wandb_project or cfg.wandb_name:
        try:
            import wandb  # noqa: F401
            from composer.loggers import WandBLogger
        except ImportError:
            raise UsageError(
                "--wandb_project/--wandb_name: wandb is not installed; pip install -e '.[wandb]' "
                "(set WANDB_MODE=offline to log without an account)"
            ) from None
        out.append(
            WandBLogger(project=cfg.wandb_project, name=cfg.wandb_name, init_kwargs={"config": dataclasses.asdict(cfg)})
        )
    if cfg.tensorboard_dir:
        try:
            import tensorboard  # noqa: F401
            from composer.loggers import TensorboardLogger
        except ImportError:
            raise UsageError("tensorboard_dir: tensorboard is not installed; pip install tensorboard") from None
        out.append(TensorboardLogger(log_dir=cfg.tensorboard_dir, flush_interval=1))
    if wants_bar(cfg.progress):
        out.append(ProgressBar(stream=sys.stderr))  # the stream of this moment (tests swap it)
    elif cfg.progress != "metrics":
        out.append(ProgressLines(cfg.log_interval, cfg.batch_size, stream=sys.stderr))
    return out


def init_device(cfg: TrainConfig, on_gpu: bool) -> str | None:
    """Where a preset's random weights are drawn: this rank's GPU, where the model goes anyway (measured on an
    H200 machine, 2026-11-26: the CPU took over 110 s to draw flux-mid's, T5-XXL's 4.7B twice over); the CPU
    under FSDP, whose sharding starts from the whole model on the host."""
    if not on_gpu or cfg.fsdp:
        return None
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"


def _built_model(cfg: TrainConfig, on_gpu: bool = False) -> Built:
    """The model the config names, with its parts, tokenizers and objective, configured for training
    (attention, gradient checkpointing, channels_last)."""
    built = build_model(
        cfg.model_name,
        init_device=init_device(cfg, on_gpu),
        tokenizers=local_parts(cfg, LOCAL_TOKENIZERS),
        prediction_type=cfg.prediction_type,
        local_parts=local_parts(cfg),
        encoder_dtype=torch_dtype(cfg.encoder_dtype),
        objective=dict(cfg.objective) or None,
        **{key: value for technique in active(cfg) for key, value in technique.build_options(cfg).items()},
    )
    built.algorithms = configure_model(built.model, cfg)
    return built


def _parallelism(cfg: TrainConfig, model) -> dict | None:
    """With ``fsdp``: the FSDP2 units marked on the model, and Composer's FSDP2 config; else None (DDP)."""
    if not cfg.fsdp:
        return None
    mark_fsdp_units(model)
    return {"fsdp": FSDP2Config(reshard_after_forward=cfg.fsdp_reshard_after_forward, state_dict_type="sharded")}


def _run_name(cfg: TrainConfig) -> str | None:
    """With autoresume and no run_name, the save folder's name: the same on every restart."""
    if cfg.autoresume and cfg.run_name is None:
        return os.path.basename(os.path.normpath(cfg.save_folder))
    return cfg.run_name


def share_cpu_threads(on_gpu: bool) -> None:
    """Ranks that share one machine's CPUs divide its cores: torch gives each process a thread per core, and
    two ranks on 2 cores with 2 threads each ran a batch 10x slower than with one each (as torchrun sets
    OMP_NUM_THREADS=1 for several ranks; Composer's launcher sets nothing). An OMP_NUM_THREADS the user set
    wins; on GPU the CPU threads only feed the device and are left alone."""
    ranks = dist.get_local_world_size()
    if on_gpu or ranks < 2 or os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // ranks))


def _dataloaders(cfg: TrainConfig, built: Built, device_batch_size: int) -> tuple:
    """The run's training loader and its validation loader (None without eval_interval). The active techniques'
    columns (what they add to precomputed batches) and checks of a dataset reach the loader as plain values."""
    techniques = active(cfg)
    data = DataSettings.of(cfg)
    train = build_train_dataloader(
        data,
        built.model,
        built.tokenizers,
        device_batch_size,
        columns=[found for t in techniques if (found := t.columns(cfg)) is not None],
        checks=[functools.partial(t.check_data, cfg) for t in techniques],
    )
    if not cfg.eval_interval:
        return train, None
    return train, build_eval_dataloader(data, built.model, built.tokenizers, device_batch_size)


@contextlib.contextmanager
def _stateless_unmissed(objects: list):
    """Composer's warning that a checkpoint lacks the entry of a callback or logger in ``objects`` silenced for those
    with no state: they have nothing to restore, and a sharded folder's file keeps no empty entry
    (torch.distributed.checkpoint)."""
    with warnings.catch_warnings():
        for stateless in {type(cb).__name__ for cb in objects if cb.state_dict() == {}}:
            warnings.filterwarnings("ignore", message=f"{stateless} is not in the state_dict")
        yield


def _build_trainer(cfg: TrainConfig, schedule_until: str, resume: ResumeLine | None = None) -> Trainer:
    on_gpu = torch.cuda.is_available()
    world = dist.get_world_size()
    share_cpu_threads(on_gpu)
    check_before_build(cfg, world_size=world, on_gpu=on_gpu)  # every setting checked before building weights
    reproducibility.seed_all(cfg.seed)
    check_locations(cfg)  # the object store behind any s3:// URL answers
    load_path = _check_checkpoints(cfg, on_gpu)
    if resume is not None:
        resume.load_path = load_path  # a sharded folder's file, when this run converted it
    built = _built_model(cfg, on_gpu)
    model = built.model
    if cfg.text_encoders_on_cpu:
        hold_text_encoders(model)
    device_batch_size = cfg.batch_size // world
    microbatch = cfg.device_train_microbatch_size
    if microbatch is None:
        microbatch = "auto" if on_gpu else device_batch_size
    train_dataloader, eval_dataloader = _dataloaders(cfg, built, device_batch_size)
    optimizer, scheduler = optimizer_and_schedule(cfg, model, on_gpu, schedule_until)
    parallelism = _parallelism(cfg, model)
    flops = model.flops_per_sample(cfg.image_size, online=not cfg.precomputed_latents)
    compile_model(model, cfg)  # after the FLOP count, which traces the eager modules
    run_loggers = loggers(cfg)
    per_node_signal_files()  # autoresume on a save_folder shared by several nodes (a Composer 0.32.1 bug)
    fast_composer_env()  # the CPU's name without py-cpuinfo's subprocess
    run_callbacks = callbacks(cfg, built, flops, on_gpu, resume)
    with _stateless_unmissed(run_callbacks + run_loggers):
        trainer = Trainer(
            model=model,
            train_dataloader=train_dataloader,
            eval_dataloader=eval_dataloader,
            eval_interval=cfg.eval_interval or 1,
            optimizers=optimizer,
            schedulers=scheduler,
            callbacks=run_callbacks,
            algorithms=built.algorithms or None,
            loggers=run_loggers,
            max_duration=cfg.max_duration,
            device_train_microbatch_size=microbatch,
            precision=cfg.precision or ("amp_bf16" if on_gpu else "fp32"),
            parallelism_config=parallelism,
            seed=cfg.seed,
            dist_timeout=cfg.dist_timeout,
            save_folder=cfg.save_folder,
            save_interval=cfg.save_interval,
            save_num_checkpoints_to_keep=cfg.save_num_checkpoints_to_keep,
            load_path=load_path,
            load_weights_only=cfg.load_weights_only,
            autoresume=cfg.autoresume,
            save_overwrite=_overwrites(cfg),
            run_name=_run_name(cfg),
            progress_bar=False,  # ours, when wanted, is in loggers
            log_to_console=cfg.progress == "metrics",
            console_log_interval=cfg.log_interval,
            python_log_level=None,
        )
    sharded_saver_fixes(trainer.state.callbacks)
    return restore_rng_after_dataset_resumption(trainer)  # mid-epoch Streaming resumes: Composer skips it

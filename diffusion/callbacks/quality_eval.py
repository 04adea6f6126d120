"""FID and CLIP score during training, on a schedule (MLPerf SD: every 512,000 samples).

At each ``interval`` (``512000sp``, ``1000ba``, ...; and once at the end of training) every rank samples its
share of the first ``num_samples`` prompts with the EMA weights when the run keeps them, the metric states
are summed over ranks, and ``metrics/quality/FID``, ``metrics/quality/CLIPScore`` (torchmetrics, 0-100)
and ``metrics/quality/CLIP_cosine`` (MLPerf's scale, target >= 0.15) go to the run's loggers. Ranks run
the same number of pipeline calls (a rank with fewer batches samples a throwaway one) so sharded (FSDP)
models stay in step. Bad paths are reported when the callback is built, before training starts.
"""

from __future__ import annotations

import contextlib

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import create_interval_scheduler, dist

from diffusion.errors import UsageError


@contextlib.contextmanager
def _as_config_keys():
    """Errors of the loaders shared with evaluate.py name its flags; here, name the run config's keys."""
    try:
        yield
    except UsageError as e:
        message = str(e)
        for name in (
            "prompts",
            "inception",
            "clip",
            "reference_images",
            "reference_stats",
            "fid_features",
            "num_samples",
        ):
            message = message.replace(f"--{name}", f"quality_{name}")
        raise UsageError(message) from None


class QualityEval(Callback):
    def __init__(
        self,
        prompts: list[str] | str,
        interval: str,
        tokenizers: dict,
        *,
        inception,
        clip,
        reference_images: str | None = None,
        reference_stats: str | None = None,
        num_samples: int | None = None,
        steps: int = 50,
        guidance_scale: float = 8.0,
        image_size: int | None = None,
        seed: int = 0,
        batch_size: int = 8,
        fid_features: int = 2048,
    ):
        from diffusion.eval.fid import list_images, read_stats
        from diffusion.eval.quality import QualityMetrics
        from diffusion.eval.sampling import read_prompts

        with _as_config_keys():
            prompts = read_prompts(prompts) if isinstance(prompts, str) else list(prompts)
            n = num_samples or len(prompts)
            if not 2 <= n <= len(prompts):
                raise UsageError(f"--num_samples {n} must be between 2 and the {len(prompts)} prompts")
            if (reference_images is None) == (reference_stats is None):
                raise UsageError("give exactly one of --reference_images or --reference_stats")
            list_images(reference_images) if reference_images else read_stats(reference_stats)  # fail fast
            self.metrics = QualityMetrics(inception, clip, fid_features=fid_features)
        self.prompts = prompts[:n]
        self.tokenizers = tokenizers
        self.reference = dict(images=reference_images, stats=reference_stats)
        self.sampling = dict(
            steps=steps, guidance_scale=guidance_scale, seed=seed, image_size=image_size, batch_size=batch_size
        )
        try:
            self.due = create_interval_scheduler(
                interval, include_end_of_training=True, checkpoint_events=False, final_events={Event.BATCH_END}
            )
        except (ValueError, NotImplementedError):
            raise UsageError(
                f"quality_interval {interval!r} is not a training time like 512000sp, 1000ba or 1ep"
            ) from None
        self.history: list[dict] = []  # one entry per evaluation: batch, fid, clip_score, ...

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        if event in (Event.BATCH_END, Event.EPOCH_END) and self.due(state, event):
            self.evaluate(state, logger)

    @torch.no_grad()
    def evaluate(self, state: State, logger: Logger) -> dict:
        from diffusion.callbacks.live_pipeline import run_pipeline
        from diffusion.eval.quality import sample_and_measure

        model = getattr(state.model, "module", state.model)  # unwrap DDP
        device = next(model.parameters()).device
        rank, world = dist.get_global_rank(), dist.get_world_size()
        if not self.metrics.has_reference:  # once: each rank's share of the reference set
            self.metrics.to(device)
            self.metrics.set_reference(
                **self.reference, rank=rank, world_size=world, batch_size=self.sampling["batch_size"]
            )
        with run_pipeline(state, self.tokenizers) as pipe:
            sample_and_measure(
                pipe,
                self.prompts,
                self.metrics,
                rank=rank,
                world_size=world,
                even_calls=True,
                autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
                **self.sampling,
            )
        results = self.metrics.compute()
        logger.log_metrics(
            {
                "metrics/quality/FID": results["fid"],
                "metrics/quality/CLIPScore": results["clip_score"],
                "metrics/quality/CLIP_cosine": results["clip_score_cosine"],
            }
        )
        self.history.append({"batch": int(state.timestamp.batch), **results})
        return results

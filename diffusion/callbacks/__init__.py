from diffusion.callbacks.image_logger import ImageLogger
from diffusion.callbacks.nan_guard import NaNGuard, TrainingDiverged
from diffusion.callbacks.quality_eval import QualityEval
from diffusion.callbacks.results import ThroughputRecorder
from diffusion.callbacks.run_config import RunConfig

__all__ = ["ImageLogger", "NaNGuard", "QualityEval", "RunConfig", "ThroughputRecorder", "TrainingDiverged"]

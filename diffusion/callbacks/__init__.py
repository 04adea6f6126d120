from diffusion.callbacks.image_logger import ImageLogger
from diffusion.callbacks.nan_guard import NaNGuard, TrainingDiverged
from diffusion.callbacks.results import ThroughputRecorder
from diffusion.callbacks.run_config import RunConfig

__all__ = ["ImageLogger", "NaNGuard", "RunConfig", "ThroughputRecorder", "TrainingDiverged"]

from diffusion.callbacks.nan_guard import NaNGuard, TrainingDiverged
from diffusion.callbacks.results import ThroughputRecorder
from diffusion.callbacks.run_config import RunConfig

__all__ = ["NaNGuard", "RunConfig", "ThroughputRecorder", "TrainingDiverged"]

from diffusion.callbacks.results import ThroughputRecorder

__all__ = ["ThroughputRecorder"]

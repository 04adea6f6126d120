"""Composer callbacks, one concern each: ema (weight averaging, FSDP2-sharded), throughput
(ThroughputRecorder: images/s, MFU, per-rank figures, stragglers), nan_guard, image_logger, quality_eval
(FID/CLIP during training), run_config (the resolved config in the logs), resume_rng (Streaming
mid-epoch resumes), preemption (stop on Slurm's signals with a checkpoint). Import each from its module."""

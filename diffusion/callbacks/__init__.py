"""Composer callbacks, one concern each: ema (weight averaging, FSDP2-sharded),
throughput_recorder (ThroughputRecorder: images/s, MFU, per-rank figures, stragglers; with batch_timer,
rank_stats and results_line, the one schema of the results line; peak_flops, MFU's denominator per GPU and
dtype, also behind Composer's SpeedMonitor), nan_guard, image_logger, quality_eval
(FID/CLIP during training), run_config (the resolved config in the logs), resume_rng (Streaming
mid-epoch resumes), preemption (stop on Slurm's signals with a checkpoint); previous_run
(save_overwrite: the old run's checkpoints deleted once this run's first one is whole); profile_window (profile=:
torch.profiler over a window of batches, with trace_summary's GPU busy/idle share and top kernels); live_pipeline (the live model as
a pipeline with the EMA weights in, for image_logger and quality_eval). Import each from its module."""

"""Benchmarking tools, each a `python -m diffusion.bench.<tool>` CLI: perf (targets: a run's figures
against published ones), sweep (grids of benchmark.py runs), throughput (tables from results files),
planning (size a cluster for a budget) and scaling (the multi-node model and its presets)."""

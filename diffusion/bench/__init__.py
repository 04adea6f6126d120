"""Benchmarking tools, each a `python -m diffusion.bench.<tool>` CLI: perf (targets: a run's figures
against published ones), sweep (grids of benchmark.py runs), throughput (tables from results files),
planning (size a cluster for a budget) and scaling (the multi-node model and its presets); beside them fit (the
microbatch a card's memory holds), measured (the lent GPUs' committed lines) and performance_docs (the tables
of docs/performance.md from those lines)."""

"""Experiments: the absl main, training loop, data and benchmarks."""

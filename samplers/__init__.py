"""Sampling: shifted sigma grids (pure math, :mod:`.schedules`) and the training-Euler AV sampler."""

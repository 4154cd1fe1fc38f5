"""Parallelism across ranks: pipeline schedules and executor, data-parallel gradient sync."""

"""Optimizers, the learning-rate schedule and loss scaling."""

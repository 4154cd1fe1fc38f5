"""Training: the trainer and its loop, the parameter-server rank, evaluation, sampling, the run report."""

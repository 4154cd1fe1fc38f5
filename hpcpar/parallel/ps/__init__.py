"""Parameter-server training: server ranks own parameters and optimizer, workers push and pull."""

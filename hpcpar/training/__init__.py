"""Training: the Trainer and its step loop (`trainer`), the update made after backward (`update`:
collective or through parameter servers), what `hpcpar train` runs (`run`), a parameter server's
rank (`server_rank`), the run's summary (`report`) and figures (`mfu`, `routing`), and the verbs built on a
trained model or run: `evaluate`, `generate`, `calibrate` (for `hpcpar plan`), `plot`."""

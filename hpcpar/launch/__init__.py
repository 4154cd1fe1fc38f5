"""Job scripts for Slurm and PBS: `hpcpar job render` and its templates."""

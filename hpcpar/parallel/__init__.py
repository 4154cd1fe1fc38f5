"""Parallelism across ranks, a folder per mechanism.

`mappings` (collectives as autograd mappings, each with its adjoint), `tp/` (tensor-parallel layers),
`cp/` (context parallelism: ring attention, Ulysses), `pp/` (schedules as data, their simulator,
the stage split and the executor), `dp/` (gradient sync: DDP, ZeRO-1/2, FSDP and expert data
parallelism as strategies; buckets, clipping, compression), `ps/` (the parameter server). `mappings`,
`tp/` and `cp/` sit in the model's layer (nn/ builds with them); `pp/`, `dp/` and `ps/` above it.
"""

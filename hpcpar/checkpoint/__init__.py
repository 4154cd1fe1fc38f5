"""Sharded HDF5 checkpoints of global tensors: atomic commit, integrity, reshard on load.

    format      file names, the tensor table, checksums and digests, reading the manifest and index
    directory   a run's checkpoint directory: step-NNNNNNN names, `latest`, commit, pruning
    collective  every failure raised on every rank alike
    writers     who writes which block; the rank-file, shared-file and index writers
    save        a save's steps, asynchronous saves (`SaveHandle`) and the commit
    load        loading into any layout (reshard), every byte read checked
    parts       saving and loading `Checkpointable` parts (hpcpar/state.py): the trainer's entry
    replicate   checkpoints on node-local disks: shared or not (probe), every file on every node
    tools       info, verify, export (one process, no MPI)
"""

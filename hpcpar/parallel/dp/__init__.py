"""Data parallelism: gradient sync strategies (DDP, ZeRO-1/2, FSDP, expert data parallel), buckets,
clipping and compression."""

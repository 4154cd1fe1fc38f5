"""Context parallelism: the sequence split over cp ranks (ring attention, DeepSpeed-Ulysses)."""

"""A model as every rank runs it: loaded (``load``), split for tensor parallelism (``tp``), its
small operations fused and projections concatenated where exact (``fused``, ``fused_weights``),
its rows batch-invariant (``invariance``)."""

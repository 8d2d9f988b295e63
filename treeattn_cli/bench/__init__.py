"""Measurement: the tree/ring/single harnesses, projections, and the GPU measurement scripts."""

"""treeattn: exact long-context decoding across GPUs with Tree Attention."""

__version__ = "0.1.0"

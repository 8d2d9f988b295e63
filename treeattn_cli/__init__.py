"""treeattn: exact long-context decoding across GPUs with Tree Attention."""

import os

__version__ = "0.1.0"

# MKL's strict reproducibility before any MKL call of this process (and of the ranks, which
# inherit it): a row's matmul then gives the same bits alone and in a batch of any size
# (model/invariance.py, which checks it on every model it loads). A value the user set wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

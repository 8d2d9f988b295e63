"""Test setup: the Triton interpreter on machines without a GPU (set before triton is imported)."""

import os
import signal

import pytest
import torch

# A run started in the background (`make test &`, nohup, some CI runners) inherits SIGINT
# ignored, as POSIX shells set for asynchronous jobs, and passes that on to the processes the
# signal tests start, which then cannot be interrupted at all. A terminal's foreground job has
# the default disposition: give it back (a handler here becomes SIG_DFL in children on exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs each run; the seed is printed on failure for reproduction."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    yield seed

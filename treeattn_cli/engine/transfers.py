"""The host's side of a decode step (issue 38): its one wait for the device, and what it sends.

A step waits for the device once: rank 0 when it reads the tokens it sampled, the other ranks
when they read the step's message. Everything else a step needs from the host (tokens, positions,
where each new token is kept, block tables) goes to the device packed in one buffer, copied once
and without waiting (from page-locked memory on CUDA: a copy from ordinary memory first waits for
the device). Every read and every copy of a step goes through :func:`read` and :class:`Staging`,
which count them: ``tests/engine/test_host.py`` checks a step makes one read and one copy, and that the
model's forward reads nothing.
"""

from __future__ import annotations

import torch

COUNTS = {"reads": 0, "sends": 0}  # since the process began (tests difference them per step)


def read(t: torch.Tensor) -> list:
    """``t``'s values as Python numbers: where a step waits for the device."""
    COUNTS["reads"] += 1
    return t.tolist()


class Staging:
    """One copy a step from host to device: :meth:`send` packs rows of integers into a host
    buffer (page-locked on CUDA; two, used in turn, so a copy in flight is never overwritten)
    and copies them to the device at once."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._host: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def send(self, *rows) -> list[torch.Tensor]:
        """Each of ``rows`` (sequences of ints, or 2-D lists) as an int64 device tensor of its
        shape, all in one copy."""
        shapes, flat = [], []
        for r in rows:
            t = torch.as_tensor(r, dtype=torch.int64)
            shapes.append(t.shape)
            flat.append(t.reshape(-1))
        host = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64)
        COUNTS["sends"] += 1
        if self.device.type != "cpu":
            buf = self._host[self._turn]
            if buf is None or buf.numel() < host.numel():
                buf = self._host[self._turn] = torch.empty(
                    max(64, 2 * host.numel()), dtype=torch.int64, pin_memory=True
                )
            self._turn ^= 1
            buf[: host.numel()].copy_(host)
            host = buf[: host.numel()].to(self.device, non_blocking=True)
        out, at = [], 0
        for shape in shapes:
            n = int(torch.Size(shape).numel())
            out.append(host[at : at + n].view(shape))
            at += n
        return out

"""The ranks of one ``treeattn serve`` over their life: started, watched, started again when a
rank is lost, stopped.

A lost rank (the ranks' thread ended, or the engine's front broke) ends the requests in flight
with the reason (the front fails them); while the old ranks stop and a new set starts,
``/health`` and new requests get 503 ``recovering``; ``--restarts`` bounds the tries
(:func:`restart_waits` apart), and a server whose ranks do not come back stops with one line.
Nothing is resident in new ranks: documents come back from ``--cache-dir`` as they are asked
for, pinned ones at once.
"""

from __future__ import annotations

import sys
import threading


def restart_waits(tries: int) -> list[float]:
    """Seconds before each try to start new ranks after a lost one (``--restarts``): 1, 2, 4... (at most 30)."""
    return [min(30.0, 2.0**i) for i in range(tries)]


class Supervised:
    """The ranks' life for a server (``cli/serve.Server``), which provides ``self.engine`` (a
    ``ResidentEngine``), ``self.catalog`` (the documents), and :meth:`_start_ranks` (the
    engine's ranks, pool and front: ``self.front``), :meth:`_new_engine` and :meth:`_restarted`.
    ``restarts``: how many times lost ranks are started again (``--restarts``)."""

    def __init__(self, restarts: int):
        self.restarts = restarts
        self.front = None
        self._failed: str | None = None
        self._recovering: str | None = None  # why the ranks are being started again (503 meanwhile)
        self._watching = self._gave_up = False
        self._stopping = threading.Event()

    def _start_ranks(self) -> None:
        raise NotImplementedError

    def _new_engine(self):
        raise NotImplementedError

    def _restarted(self) -> None:
        """A new set of ranks serves (the metrics count it)."""

    def watch(self, give_up) -> None:
        """From now on a lost rank (or a broken front) starts a new set of ranks (:meth:`recover`);
        ``give_up()`` when they do not come back."""

        def loop():
            while not self._stopping.wait(0.2):
                reason = self._lost()
                if reason is not None and not self.recover(reason):
                    give_up()
                    return

        self._watching = True
        threading.Thread(target=loop, name="treeattn-watch", daemon=True).start()

    def recover(self, reason: str) -> bool:
        """The ranks are gone (``reason``): the requests in flight have ended with it (the front
        fails them); new requests get 503 ``recovering`` while the old ranks are stopped and a new
        set starts, up to ``--restarts`` times (:func:`restart_waits` apart). Nothing is resident in
        new ranks: the documents come back from ``--cache-dir`` as they are asked for, pinned ones
        at once.
        Returns whether the server serves again (or is stopping)."""
        waits = restart_waits(self.restarts)
        if waits:
            self._recovering = reason
            print(f"treeattn serve: {reason}; starting the ranks again", file=sys.stderr, flush=True)
        if self.front is not None:
            self.front.shutdown()
            self.front.join(timeout=15)
        self.engine.stop(now=True)
        self.catalog.restarted()
        for wait in waits:
            if self._stopping.wait(wait):
                return True
            self.engine = self._new_engine()
            try:
                self._start_ranks()
            except Exception as e:  # noqa: BLE001 - said below, and tried again
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                self.engine.stop(now=True)
                continue
            if self._stopping.is_set():  # stopped while they started: stop them too
                self.engine.stop(now=True)
                return True
            self._failed, self._recovering = None, None
            self._restarted()
            self._pin_again()
            print("treeattn serve: the ranks are back; serving", file=sys.stderr, flush=True)
            return True
        self._failed = (
            f"the ranks did not come back after {len(waits)} tr{'y' if len(waits) == 1 else 'ies'} "
            f"(--restarts): {reason}"
            if waits
            else f"{reason} (--restarts 0: not restarted)"
        )
        self._recovering, self._gave_up = None, True
        print(f"treeattn serve: error: {self._failed}", file=sys.stderr, flush=True)
        return False

    def _pin_again(self) -> None:
        """Pinned documents never leave memory: into the new ranks' pools now (from disk, else
        prefilled from their tokens), off the request path."""
        pinned = [(k, e.ids) for k, e in list(self.catalog.entries.items()) if e.pinned]
        for key, ids in pinned:
            self.front.document(key, ids, {"pin": True}, deliver=lambda event: None)

    def fail(self, reason: str) -> None:
        """The ranks cannot go on (``reason``): :meth:`watch` starts new ones."""
        self._failed = self._failed or reason

    def _lost(self) -> str | None:
        """Why the ranks or the front stopped (a lost rank, a broken front), or None."""
        if self._failed is None and self.front is not None and self.front.failed:
            self._failed = self.front.failed
        if self._failed is None and self.engine.thread is not None and not self.engine.thread.is_alive():
            err = self.engine.error
            self._failed = str(err) if err is not None else "the ranks stopped"
        return self._failed

    @property
    def recovering(self) -> str | None:
        """Why the ranks are being started again (lost, and :meth:`watch` will start new ones), or None."""
        if self._recovering is None and self._watching and self.restarts and not self._gave_up:
            return self._lost()
        return self._recovering

    @property
    def failed(self) -> str | None:
        """Why the server cannot answer now (its ranks being started again, or gone), or None."""
        return self.recovering or self._lost()

    def stop(self) -> None:
        """Stop for good: the front ends the answers under way, then the ranks stop."""
        self._stopping.set()
        front = self.front
        if front is not None:
            front.shutdown()
            front.join(timeout=15)
        self.engine.stop(now=(front is not None and front.is_alive()) or self.failed is not None)

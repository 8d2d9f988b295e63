"""The launching process's side of a resident engine (``chat``, ``serve``): the ranks run in a
background thread of this process (``launch.run_local``), while this process posts requests
through the rendezvous store it hosts (``comm.post_request``) and reads rank 0's events from a
queue."""

from __future__ import annotations

import queue
import threading

from ..parallel import comm as C
from ..parallel import forkserver, launch


class EngineClient:
    """The launcher's handle on the running engine: post requests, read rank 0's events."""

    def __init__(self, store, events: "queue.Queue", failed):
        self.store, self.events, self.failed = store, events, failed
        self.seq = 0

    def post(self, **req) -> int:
        seq = self.seq
        C.post_request(self.store, seq, req)
        self.seq += 1
        return seq

    def interrupt(self, seq: int) -> None:
        C.post_interrupt(self.store, seq)

    def next_event(self, timeout: float = 0.2):
        """``(kind, payload)`` of rank 0's next event, or None after ``timeout``; the ranks'
        failure is raised here once they have stopped."""
        try:
            what, payload = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if what == "__end__":
            raise self.failed() or launch.LaunchError("the ranks stopped")
        return what, payload

    def wait(self, kind: str, on_event=None):
        """Events until one of ``kind`` (returned); the ranks' failure is raised here."""
        while True:
            got = self.next_event()
            if got is None:
                continue
            what, payload = got
            if on_event is not None:
                on_event(what, payload)
            if what == kind:
                return payload


class ResidentEngine:
    """Start the ranks of ``run`` (``cli/prepare.Run``) serving ``job`` in a background thread;
    ``client`` talks to them once :meth:`start` returns. :meth:`stop` ends them (at once with
    ``now``), and ``error`` is what stopped them, if anything did."""

    def __init__(self, run, job, timeout_s: float):
        self.run, self.job, self.timeout_s = run, job, timeout_s
        self.events: queue.Queue = queue.Queue()
        self.abort = threading.Event()
        self._box: dict = {}
        self._started = threading.Event()
        self.client: EngineClient | None = None
        self.thread: threading.Thread | None = None

    @property
    def error(self):
        return self._box.get("error")

    def start(self) -> EngineClient:
        from ..engine.engine import rank_engine

        def ranks():
            try:
                launch.run_local(
                    rank_engine,
                    self.run.nproc,
                    self.job,
                    backend=self.run.backend,
                    devices=self.run.devices,
                    timeout_s=self.timeout_s,
                    on_event=lambda r, k, v: self.events.put((k, v)),
                    on_start=lambda store: (self._box.setdefault("store", store), self._started.set()),
                    abort=self.abort,
                )
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                self._box["error"] = e
            finally:
                self._started.set()
                self.events.put(("__end__", None))

        forkserver.warm()  # from the main thread: the fork server dies with its thread
        self.thread = threading.Thread(target=ranks, name="treeattn-ranks", daemon=True)
        self.thread.start()
        self._started.wait()
        if self._box.get("store") is None:  # the ranks never started
            raise self.error or launch.LaunchError("the ranks did not start")
        self.client = EngineClient(self._box["store"], self.events, lambda: self.error)
        return self.client

    def stop(self, now: bool = False) -> None:
        """Ask the ranks to leave (``now``: stop them at once) and wait for them."""
        if self.thread is None:
            return
        if now:
            self.abort.set()
        elif self.client is not None and self.thread.is_alive():
            try:
                self.client.post(op="stop")
            except Exception:  # the store is gone: nothing to ask
                self.abort.set()
        self.thread.join(timeout=10 if now else 30)
        if self.thread.is_alive():
            self.abort.set()
            self.thread.join(10)

"""What SIGTERM and SIGINT (Ctrl-C) do to a job, from the first line of ``main`` to its exit.

Two phases:

- start-up (``StopSignals`` installed, ``training()`` not yet called): reading the config,
  building the mesh, initialising or restoring the state, the step-0 eval and compiling the
  train step; ``--mode=eval`` is start-up from beginning to end. Nothing needs saving yet, so
  the first signal ends the process at once: one line on stderr, exit status ``128 + signal``
  (143 for SIGTERM, 130 for SIGINT).
- training (after ``training()``): the first signal asks the loop to stop after the step in
  flight and save a checkpoint (``stop_requested``); a second one ends the process at once,
  without saving (the checkpoints already written stay), with the same exit status.

An XLA compile (or any long call into C++) cannot be interrupted from Python: the interpreter
runs a Python signal handler only when the main thread gets back to Python code. So the signal
also wakes a watcher thread (``signal.set_wakeup_fd``), which acts while the main thread is
still inside the compile; the Python handler acts when the main thread comes back first (a
signal a process sends itself is then seen before its next line). Each signal is acted on once,
by whichever of the two sees it first.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The job's exit status after a stop signal: 128 + its number, as shells report it."""
    return 128 + int(signum)


class StopSignals:
    """Installs the handlers of SIGTERM and SIGINT (from the main thread) until ``uninstall``;
    a context manager. ``prog`` prefixes the line printed when the process ends at once."""

    def __init__(self, prog: str = "experiments.main"):
        self.prog = prog
        self._training = False
        self._requested = None  # the first signal of the training phase
        self._acted = 0  # signals acted on
        self._seen = {"handler": 0, "watcher": 0}  # signals each route has seen
        self._lock = threading.RLock()  # the Python handler runs in the main thread
        self._old = None
        self._old_wakeup = -1
        self._pipe = None

    # -- state the loop reads and sets
    def training(self) -> None:
        """From now on the first signal asks for a stop and a save; a second ends at once."""
        with self._lock:
            self._training = True

    @property
    def stop_requested(self):
        """The name of the signal that asked the loop to stop ('SIGTERM', 'SIGINT'), or None."""
        with self._lock:
            return None if self._requested is None else signal.Signals(self._requested).name

    # -- install / uninstall
    def install(self) -> "StopSignals":
        if self._old is not None:
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)  # set_wakeup_fd needs a non-blocking descriptor
        self._pipe = (r, w)
        self._old = {s: signal.signal(s, self._on_handler) for s in SIGNALS}
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r, ), name="stop-signals", daemon=True).start()
        return self

    def uninstall(self) -> None:
        if self._old is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = None
        os.close(self._pipe[1])  # the watcher reads end-of-file and returns; it closes r

    def __enter__(self) -> "StopSignals":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- the two routes a signal takes
    def _on_handler(self, signum, frame) -> None:
        self._deliver(signum, "handler")

    def _watch(self, r: int) -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data:
                    return
                for signum in data:
                    if signum in SIGNALS:
                        self._deliver(signum, "watcher")
        finally:
            os.close(r)

    def _deliver(self, signum: int, route: str) -> None:
        """Acts on the n-th signal once: the route that sees it first acts, the other skips it
        (both see the same signals in the same order)."""
        with self._lock:
            self._seen[route] += 1
            if self._seen[route] <= self._acted:
                return
            self._acted = self._seen[route]
            name = signal.Signals(signum).name
            if not self._training:
                self._exit_now(signum, f"stopped by {name} during start-up; nothing to save yet")
            elif self._requested is None:
                self._requested = signum
            else:
                self._exit_now(
                    signum, f"a second stop signal ({name}): exiting now without saving "
                    "the step in flight; the checkpoints written so far stay")

    def _exit_now(self, signum: int, why: str) -> None:
        status = exit_status(signum)
        try:
            sys.stdout.flush()
            print(f"{self.prog}: {why} (exit status {status})", file=sys.stderr, flush=True)
        finally:
            os._exit(status)

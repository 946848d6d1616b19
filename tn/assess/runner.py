# Runs each door of `tn assess` in its own forked process with a timeout, showing a live progress bar per door.
"""Door processes.

Each door runs in a child made with ``fork`` (the model, inputs and CPU
reference are inherited, nothing is pickled on the way in), so a door that
raises, hangs or crashes the interpreter is reported and the next door runs.
Autograd cannot run in a forked child once the parent has run a backward
pass (torch refuses), so training steps use ``spawn`` children instead: the
arguments are serialised with ``torch.save`` and the file that defines the
model's classes (``import_file``) is imported again first.
The child sends ``("progress", stage, fraction)`` messages and finally
``("result", dict)`` through a pipe. The parent draws one bar per door; on a
terminal it redraws every quarter second with the elapsed time, elsewhere it
prints a line per stage and one every 10 s within a long stage (long work
never looks hung).
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import sys
import time
from typing import Any, Callable, Dict, Optional, TextIO

import torch

import tn  # noqa: F401  (the device and backends)

from ..device import allocator
from .doors import error_info
from .target import import_file as _import

__all__ = ["run_in_child", "ProgressBar"]


class ProgressBar:
    """One line per door: ``[jit      ] ######------  50%  steady call 1/2   3.1 s``."""

    WIDTH = 24
    HEARTBEAT_S = 10.0

    def __init__(self, label: str, stream: Optional[TextIO] = None, enabled: bool = True):
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.stage = "starting"
        self.frac = 0.0
        self._last_stage = None
        self._last_line = 0.0

    def line(self) -> str:
        """The bar's text now."""
        n = int(round(self.frac * self.WIDTH))
        return (f"  [{self.label:<8}] {'#' * n}{'-' * (self.WIDTH - n)} {100 * self.frac:3.0f}%  "
                f"{self.stage[:44]:<44} {time.perf_counter() - self.t0:6.1f} s")

    def update(self, stage: Optional[str] = None, frac: Optional[float] = None) -> None:
        """Set the stage/fraction and redraw (a terminal redraws in place; else one line per new stage)."""
        if stage is not None:
            self.stage = stage
        if frac is not None:
            self.frac = max(0.0, min(1.0, frac))
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line())
            self.stream.flush()
        elif self.stage != self._last_stage or time.perf_counter() - self._last_line >= self.HEARTBEAT_S:
            self._last_stage = self.stage   # not a terminal: a line per stage, and one every HEARTBEAT_S while busy
            self._last_line = time.perf_counter()
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def finish(self, verdict: str) -> None:
        """Final state of the bar with ``verdict`` (ok / FAIL ...)."""
        self.stage = verdict
        if not self.enabled:
            return
        self.frac = 1.0 if verdict.startswith("ok") else self.frac
        text = self.line()
        self.stream.write(("\r" + text + "\n") if self.tty else (text + "\n"))
        self.stream.flush()


def _serve(conn: Any, fn: Callable[..., Dict[str, Any]], args: tuple) -> None:
    try:
        res = fn(lambda stage, frac: conn.send(("progress", stage, frac)), *args)
        conn.send(("result", res))
    except BaseException as e:  # noqa: BLE001  (report, the parent decides)

        try:
            conn.send(("result", {"status": "error", "error": error_info(e, "door process")}))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()


def _fork_child(conn: Any, fn: Callable[..., Dict[str, Any]], args: tuple) -> None:
    torch.set_num_threads(1)   # a forked child must not reuse the parent's OpenMP thread team

    allocator.reinit_after_fork()   # the child owns its copy of the (host-memory) device, used on purpose
    _serve(conn, fn, args)
    os._exit(0)   # no atexit handlers of the parent's libraries in the child


def _spawn_child(conn: Any, import_file: Optional[str], blob: bytes) -> None:
    try:
        if import_file:
            _import(import_file)
        fn, args = torch.load(io.BytesIO(blob), weights_only=False)
    except BaseException as e:  # noqa: BLE001

        conn.send(("result", {"status": "error", "error": error_info(e, "loading the model in the door process")}))
        conn.close()
        return

    _serve(conn, fn, args)


def run_in_child(label: str, fn: Callable[..., Dict[str, Any]], timeout_s: float, args: tuple = (),
                 show: bool = True, stream: Optional[TextIO] = None, spawn: bool = False,
                 import_file: Optional[str] = None) -> Dict[str, Any]:
    """Run ``fn(progress, *args)`` in a child process (forked; ``spawn=True``: a fresh interpreter, ``fn`` and
    ``args`` serialised, ``import_file`` imported first); its dict result, or a ``status`` of
    ``timeout``/``crash``."""
    ctx = mp.get_context("spawn" if spawn else "fork")
    parent, child = ctx.Pipe(duplex=False)
    bar = ProgressBar(label, stream, show)
    if spawn:
        bar.update("serialising the model for a fresh process", 0.0)
        buf = io.BytesIO()
        try:
            torch.save((fn, args), buf)
        except Exception as e:  # noqa: BLE001  (an unpicklable model: say what to change)
            bar.finish("FAIL: error at serialising the model")
            return {"status": "error", "wall_s": 0.0, "error": {
                "stage": "serialising the model", "type": type(e).__name__, "where": None, "traceback": "",
                "message": f"training steps run each door in a fresh process, so the model and inputs must pickle "
                           f"(classes defined at module level, not inside a function): {e}"}}
        proc = ctx.Process(target=_spawn_child, args=(child, import_file, buf.getvalue()), daemon=True)
    else:
        proc = ctx.Process(target=_fork_child, args=(child, fn, args), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    child.close()
    result: Optional[Dict[str, Any]] = None
    while result is None:
        left = timeout_s - (time.perf_counter() - t0)
        if left <= 0:
            proc.kill()
            proc.join(5)
            result = {"status": "timeout", "error": {
                "stage": bar.stage, "type": "Timeout", "where": None, "traceback": "",
                "message": f"no result after {timeout_s:.0f} s (stage: {bar.stage}); raise --timeout if it "
                           f"is only slow"}}
            break
        if parent.poll(min(0.25, left)):
            try:
                msg = parent.recv()
            except EOFError:
                proc.join(5)
                code = proc.exitcode
                why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                result = {"status": "crash", "error": {
                    "stage": bar.stage, "type": "Crash", "where": None, "traceback": "",
                    "message": f"the door's process died ({why}) during: {bar.stage}"}}
                break
            if msg[0] == "progress":
                bar.update(msg[1], msg[2])
            else:
                result = msg[1]
        else:
            bar.update()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    parent.close()
    result["wall_s"] = time.perf_counter() - t0
    st = result.get("status")
    bar.finish("ok" if st == "ok" else f"FAIL: {st}" + (f" at {result['error']['stage']}"
                                                        if result.get("error") else ""))
    return result

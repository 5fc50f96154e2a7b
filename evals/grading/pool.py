"""Grading in worker processes, each item under a hard time limit.

A verdict on an output ("timeout" included) is the only thing an item can get from here. A failure
of the grader itself (a worker that dies, that cannot start, or that hits a bug) raises
`GraderError`: it must end the run, never pass for a wrong answer.
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

from evals.datasets import KINDS
from evals.grading.verdict import Grade, GradeRequest, check_timeout, grade

PROGRESS_MIN_ITEMS = 64  # grade_many shows a progress bar from this many requests on
_PYTHON_START_METHODS = ("fork", "spawn", "forkserver")


class GraderError(RuntimeError):
    """The grader failed (not the output): a worker died, could not start, or raised."""


def grade_many(requests: list[GradeRequest], workers: int = 2, timeout: int = 10) -> list[Grade]:
    """Grade every request in worker processes; results in input order.

    `timeout` is a hard limit per item, in whole seconds: a worker still busy past it is killed and
    replaced, and its item gets reason "timeout"; the other items go on. Works from the main thread
    of any process, CUDA initialised or not (see `_Worker`). Raises GraderError if a worker dies on
    its own (a crash, out of memory) or raises.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    check_timeout(timeout)
    kinds = {request.kind for request in requests}
    if not kinds <= set(KINDS):
        raise ValueError(f"request kinds must be in {KINDS}, got {sorted(kinds - set(KINDS))}")
    grades: list[Grade | None] = [None] * len(requests)
    pending = list(reversed(range(len(requests))))  # popped from the end: input order
    progress = tqdm(total=len(requests), desc="grading", unit="item",
                    disable=len(requests) < PROGRESS_MIN_ITEMS)
    # math-verify's own alarms get half the hard limit, so a slow but interruptible comparison ends
    # as a "timeout" inside its worker, and only work that ignores signals costs a process.
    soft_timeout = max(1, timeout // 2)
    pool: list[_Worker] = []
    try:
        for _ in range(min(workers, len(requests))):
            pool.append(_Worker(soft_timeout))
            pool[-1].assign(pending, requests, timeout)
        while any(worker.index is not None for worker in pool):
            busy = [worker for worker in pool if worker.index is not None]
            ready = wait([worker.conn for worker in busy],
                         timeout=max(0.0, min(worker.deadline for worker in busy) - time.monotonic()))
            for slot, worker in enumerate(pool):
                if worker.index is None:
                    continue
                if worker.conn in ready:
                    grades[worker.index] = worker.receive()
                elif time.monotonic() >= worker.deadline:  # hung past the limit: replace it
                    grades[worker.index] = Grade(False, None, "timeout")
                    worker.close()
                    worker = pool[slot] = _Worker(soft_timeout)
                else:
                    continue
                progress.update()
                worker.assign(pending, requests, timeout)
    finally:
        progress.close()
        for worker in pool:
            worker.close()
    return grades  # type: ignore[return-value]  # every slot is filled once the loop ends


class _Worker:
    """One grading process, fed one request at a time through its own pipe.

    A pipe per worker, not a shared queue: killing a worker mid-write then breaks only its own pipe,
    never a lock that the other workers share. Workers start from a fork server, a clean process that
    never ran the caller's CUDA context or threads, with the grader preloaded so that a replacement
    starts in milliseconds.
    """

    def __init__(self, timeout: int):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["evals.grading"])
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, timeout), daemon=True)
        try:
            with _standard_start_method():
                self.process.start()
        except Exception as error:  # no process, no grade: the run cannot be graded here
            raise GraderError(f"cannot start a grading process ({type(error).__name__}: {error})") from error
        finally:
            child.close()
        self.answered = 0
        self.index: int | None = None
        self.deadline = math.inf

    def assign(self, pending: list[int], requests: list[GradeRequest], timeout: int) -> None:
        """Send the next pending request, or go idle when none is left."""
        self.index = pending.pop() if pending else None
        if self.index is not None:
            self.deadline = time.monotonic() + timeout
            try:
                self.conn.send(requests[self.index])
            except OSError:  # it died already: `wait` then reports its pipe closed, and `receive` raises
                pass

    def receive(self) -> Grade:
        """The worker's grade; GraderError if it died or failed instead of answering."""
        try:
            outcome = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(timeout=5)
            if self.answered == 0:
                raise GraderError(
                    f"a grading process exited (code {self.process.exitcode}) before grading anything. When "
                    "grade_many is called from a script, guard the call with `if __name__ == \"__main__\":` "
                    "(its workers import the script); see the worker's error above"
                ) from None
            raise GraderError(f"a grading process died (exit code {self.process.exitcode}) on item "
                              f"{self.index}; the item was not graded") from None
        self.answered += 1
        if isinstance(outcome, Grade):
            return outcome
        raise GraderError(f"the grader failed on item {self.index}: {outcome}")

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


@contextmanager
def _standard_start_method() -> Iterator[None]:
    """A new worker sets the parent's default start method by name before anything else. Under a
    launcher that installs its own (loky's, in Hydra's joblib launcher), that name is unknown to the
    fresh process, which dies before grading: the default is Python's own while a worker starts."""
    current = multiprocessing.get_start_method(allow_none=True)
    if current in (None, *_PYTHON_START_METHODS):
        yield
        return
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(current, force=True)


def _worker_main(conn: Connection, timeout: int) -> None:
    """Grade requests from `conn` until it closes, in the worker's main thread as math-verify needs.
    A bug answers with its traceback's last line, so that the parent raises it rather than wait."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        try:
            outcome = grade(request.kind, request.output, request.gold, finish_reason=request.finish_reason,
                            thinks=request.thinks, timeout=timeout)
        except Exception as error:
            traceback.print_exc()
            outcome = f"{type(error).__name__}: {error}"
        conn.send(outcome)

"""BatchThread: one decode thread fed by asyncio callers.

Callers on the event loop queue jobs and await their futures; the thread takes a group of the
queued jobs (which ones is the subclass's choice), runs the group in one call and resolves each
job's future on the loop that queued it. Jobs whose caller went away are skipped.
"""

from __future__ import annotations

import asyncio
import threading


def resolve_future(fut: asyncio.Future, result: object, error: BaseException | None) -> None:
    if fut.done():  # the call was cancelled meanwhile
        return
    if isinstance(error, asyncio.CancelledError):
        fut.cancel()
    elif error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class BatchThread:
    """Subclasses set their own fields, then call BatchThread.__init__ (it starts the thread), and
    define choose (which pending jobs form the next group) and run (results, in group order).
    A job is any object with `future` and `loop` attributes."""

    def __init__(self, name: str):
        self._cond = threading.Condition()
        self._pending: list = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def choose(self, pending: list) -> list:
        raise NotImplementedError

    def run(self, group: list) -> list:
        raise NotImplementedError

    def queue(self, job) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._thread.name} is closed")
            self._pending.append(job)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _take(self) -> list | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if not self._pending:
                return None
            group = self.choose(self._pending)
            taken = {id(j) for j in group}
            self._pending = [j for j in self._pending if id(j) not in taken]
            return group

    def _loop(self) -> None:
        while (group := self._take()) is not None:
            group = [j for j in group if not j.future.cancelled()]  # best effort: skip abandoned jobs
            if not group:
                continue
            try:
                results = [(r, None) for r in self.run(group)]
            except BaseException as e:  # noqa: BLE001 - reported to every job of the group
                results = [(None, e)] * len(group)
            for job, (res, err) in zip(group, results):
                job.loop.call_soon_threadsafe(resolve_future, job.future, res, err)

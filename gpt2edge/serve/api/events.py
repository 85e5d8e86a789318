"""A job's events on their way from the scheduler thread to its response: bounded, so a client that reads
slowly cannot make the server hold its whole completion in memory."""

from __future__ import annotations

import asyncio

from gpt2edge.serve.scheduling.jobs import Event, Failure, Job

SLOW_READER = (
    "This stream was dropped: the client read it too slowly ({limit} events waiting to be sent). Read the "
    "stream as it arrives, or ask for fewer tokens or choices."
)


class EventBuffer:
    """emit() from the scheduler thread; get() on the event loop. Past `limit` undelivered events the job is
    cancelled (its rows freed at the next step) and the client gets one error event after what it has not
    read yet."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self._loop, self._limit = loop, limit
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.job: Job | None = None
        self.overflowed = False

    def emit(self, event: Event) -> None:  # the scheduler thread
        try:
            self._loop.call_soon_threadsafe(self._put, event)
        except RuntimeError:  # the loop is closed: the server stopped, nobody is waiting
            pass

    def _put(self, event: Event) -> None:  # the event loop
        if self.overflowed:
            return
        if self._queue.qsize() >= self._limit:
            self.overflowed = True
            if self.job is not None:
                self.job.cancel()
            event = Failure(SLOW_READER.format(limit=self._limit), "slow_reader")
        self._queue.put_nowait(event)

    async def get(self) -> Event:
        return await self._queue.get()

    def qsize(self) -> int:
        return self._queue.qsize()

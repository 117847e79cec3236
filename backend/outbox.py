"""Engine outputs to a request's responses, sent from a thread of their own.

The engine calls a request's output callback from its step loop. Sending a Triton response is
an IPC round trip to the server process (on the order of 0.1 ms), so sending 64 of them inline
would add several milliseconds to every step of a 64-sequence batch: the step loop would spend
its time on IPC instead of the model. Here the step loop only queues the output on its request
and hands the request to an `Outbox`, whose sender threads send what is queued. A request
stays on one sender thread for its life, so the order of its responses is kept.

A stream keeps at most two responses waiting for a sender: past that, what it produces is
merged into the newer of the two. So a response carries one token while the senders keep up
(or fall one behind for a moment), several when they lag (vLLM's output collector merges the
same way, into one). Sending every token as its own response once they pile up only grows the
backlog: on an H200 the engine made a step of 64 streams every 3.5-5 ms while the llm stub's
senders spent ~0.24 ms of CPU on each response, and without merging the streams' tokens
arrived later and later. With a cap on responses per engine step, a request the cap holds back
merges what it accumulates into one response, so the response rate stays bounded however many
streams run, and no token is lost.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable, NamedTuple, Optional

from backend.outputs import RequestOutput

log = logging.getLogger(__name__)

SendOutput = Callable[[RequestOutput, bool], None]  # (output, is_last_response)
SendError = Callable[[RequestOutput], None]


class OutboxStats(NamedTuple):
    """Responses sent, and the sender threads' CPU and wall seconds spent sending (Outbox.stats)."""

    responses: int
    send_cpu_s: float
    send_wall_s: float


class StreamResponder:
    """One request's engine outputs (its `n` samples) as responses.

    Streaming: one response per output of a sample, at least `stream_interval` new tokens each
    (SGLang's --stream-interval) unless it finishes the sample. Not streaming: one response per
    sample, when it finishes. The response that ends the last sample is the last one; an error
    on any sample ends the request with that error, once. A sample keeps at most two responses
    waiting for the sender, one while the outbox's per-step cap holds the request back; what
    arrives past that is merged into its newest waiting one. Order is kept, no token is lost.
    """

    def __init__(
        self,
        outbox: "Outbox",
        n: int,
        stream: bool,
        send_output: SendOutput,
        send_error: SendError,
        stream_interval: int = 1,
        on_output: Optional[Callable[[RequestOutput], None]] = None,
        on_final: Optional[Callable[[], None]] = None,
        on_sent: Optional[Callable[[], None]] = None,
    ) -> None:
        self._outbox = outbox
        self._stream = stream
        self._interval = max(1, stream_interval)
        self._send_output = send_output
        self._send_error = send_error
        self._on_output = on_output
        self.on_final = on_final  # the last response is taken, before it is sent
        self.on_sent = on_sent  # the last response has been sent (or its send failed)
        self._remaining = n
        self._lock = threading.Lock()
        self._partial: dict[int, RequestOutput] = {}  # sample index -> below stream_interval yet
        self._outgoing: list[RequestOutput] = []  # ready to send, in order
        self._error: Optional[RequestOutput] = None
        self._done = False  # error taken or last response taken: nothing more is sent
        self.deferred = False  # set by the outbox while the cap holds this request back
        self.lane = outbox.assign_lane()

    def __call__(self, out: RequestOutput) -> None:
        """The engine's output callback (step-loop thread): queue or merge, never send."""
        if self._on_output is not None:
            self._on_output(out)
        with self._lock:
            if self._done or self._error is not None:
                return
            if out.error is not None:
                self._error = out
            else:
                prev = self._partial.pop(out.index, None)
                if prev is not None:
                    out = prev.merge(out)
                if not out.finished and not (self._stream and len(out.new_token_ids) >= self._interval):
                    self._partial[out.index] = out
                    return
                self._enqueue(out)
        self._outbox.put(self)

    def _enqueue(self, out: RequestOutput) -> None:
        waiting = [i for i, o in enumerate(self._outgoing) if o.index == out.index]
        if len(waiting) >= (1 if self.deferred else 2):
            self._outgoing[waiting[-1]] = self._outgoing[waiting[-1]].merge(out)
        else:
            self._outgoing.append(out)

    def flush(self) -> int:
        """Send what is ready (sender thread); returns how many responses went out."""
        with self._lock:
            if self._done:
                return 0
            error = self._error
            batch: list[tuple[RequestOutput, bool]] = []
            if error is not None:
                self._done = True
            else:
                for out in self._outgoing:
                    last = False
                    if out.finished:
                        self._remaining -= 1
                        last = self._remaining == 0
                    batch.append((out, last))
                self._outgoing = []
                self._done = any(last for _, last in batch)
        final = error is not None or self._done
        if final and self.on_final is not None:
            self.on_final()
        try:
            if error is not None:
                self._send_error(error)
                return 1
            for out, last in batch:
                self._send_output(out, last)
            return len(batch)
        finally:
            if final and self.on_sent is not None:
                self.on_sent()


class _Lane:
    """One sender thread flushing the responders handed to it, oldest first (see `Outbox`)."""

    def __init__(self, name: str, budget: Optional[int], idle_release_s: float) -> None:
        self._cond = threading.Condition()
        self._queue: dict[StreamResponder, None] = {}  # insertion-ordered set: oldest first
        self._budget = budget
        self._credits = budget or 0
        self._idle_release_s = idle_release_s
        self._stopped = False
        # What sending costs this process (see Outbox.stats); written by this lane's thread only.
        self.responses = 0
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, responder: StreamResponder) -> None:
        with self._cond:
            if responder not in self._queue:
                was_empty = not self._queue
                self._queue[responder] = None
                # Wake the sender only when it can act: it has credits, or it sleeps without a
                # timeout on an empty queue. Out of credits it waits for the next tick; waking it
                # for each of a step's 64 outputs only made it take the GIL from the step loop.
                if was_empty or self._budget is None or self._credits > 0:
                    self._cond.notify()

    def tick(self) -> None:
        if self._budget is None:
            return
        with self._cond:
            self._credits = self._budget
            self._cond.notify()

    def _take(self) -> Optional[list[StreamResponder]]:
        with self._cond:
            while True:
                if self._stopped and not self._queue:
                    return None
                if self._queue and (self._budget is None or self._credits > 0 or self._stopped):
                    break
                if self._queue:  # out of credits (so there is a cap): wait for a step
                    if not self._cond.wait(self._idle_release_s):
                        self._credits = self._budget
                else:
                    self._cond.wait()
            if self._budget is None or self._stopped:
                batch = list(self._queue)
            else:
                batch = list(itertools.islice(self._queue, self._credits))
                self._credits -= len(batch)
            for responder in batch:
                del self._queue[responder]
                responder.deferred = False
            for responder in self._queue:  # held back by the cap: one merged response until their turn
                responder.deferred = True
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            for responder in batch:
                try:
                    self.responses += responder.flush()
                except Exception:  # one request's failed send must not stop the others'
                    log.exception("sending a response failed")
            self.cpu_s += time.thread_time() - cpu0
            self.wall_s += time.perf_counter() - wall0

    def close(self, timeout: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)


class Outbox:
    """Sender threads ("lanes") flushing the responders handed to them, oldest first.

    Each request is bound to one lane for its life, so its responses keep their order. A
    Triton decoupled send is a synchronous round trip to the server process (the stub waits
    until the server has taken the response), so one thread has one response in flight; a
    single sender at c=64 spent most of its time waiting in send. With four lanes and no cap,
    ITL p99 through tritonserver was 57-148 ms against 86-498 ms with one (2 cores).

    `responses_per_step` caps how many responders are flushed per engine step (`tick`), across
    all lanes. Every response crosses the server's ensemble, a postprocessing call and gRPC: on
    a small CPU machine those cost more than the model's step once there are dozens of streams,
    and the whole server slows down. With a cap, a stream that has to wait keeps accumulating
    tokens and goes out as one larger response a few steps later, so the response rate per step
    stays bounded while every token still arrives, in order. None: no cap (a stream's response
    goes out as soon as a sender is free). The engine ticks when it goes idle as well; when no
    tick comes for `idle_release_s` (a step that runs long), what is queued is released anyway. That timer
    must be longer than a busy step: at 20 ms it fired two or three times per 50-60 ms step of
    64 streams on 2 cores, so the cap never held and throughput was 9% lower (alternating runs).
    """

    def __init__(
        self,
        name: str = "outbox",
        responses_per_step: Optional[int] = None,
        idle_release_s: float = 0.25,
        senders: int = 1,
    ) -> None:
        senders = max(1, senders)
        budget = responses_per_step if responses_per_step and responses_per_step > 0 else None
        lane_budget = None if budget is None else max(1, -(-budget // senders))
        self._lanes = [
            _Lane(name if senders == 1 else f"{name}-{i}", lane_budget, idle_release_s) for i in range(senders)
        ]
        self._next_lane = itertools.count()

    def assign_lane(self) -> int:
        """The lane for a new request: round robin, fixed for the request's life."""
        return next(self._next_lane) % len(self._lanes)

    def put(self, responder: StreamResponder) -> None:
        self._lanes[responder.lane].put(responder)

    def stats(self) -> OutboxStats:
        """Responses sent so far, and the sender threads' CPU and wall time spent sending them.
        CPU per response is what the stream path costs the process the engine runs in: in a
        Triton Python stub, mostly time holding the GIL, which the engine's step loop needs too."""
        return OutboxStats(sum(lane.responses for lane in self._lanes), sum(lane.cpu_s for lane in self._lanes),
                           sum(lane.wall_s for lane in self._lanes))

    def tick(self) -> None:
        """An engine step ended: another `responses_per_step` may go out."""
        for lane in self._lanes:
            lane.tick()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the threads."""
        for lane in self._lanes:
            lane.close(timeout)

"""The end of a response's life on this rank: handles completed, timeline closed, cache fed.

Both executors finish their responses through one :class:`Completer`, so a tensor completes
the same way whichever device it lives on.
"""
from typing import Dict, List, Optional, Sequence, Union

from aiak_training.common.messages import Response
from aiak_training.common.timeline import Timeline
from aiak_training.runtime.entries import HandleTable, SetState


class Completer:
    def __init__(self, handles: HandleTable, timeline: Timeline):
        self.handles = handles
        self.timeline = timeline

    def activity(self, what: Union[Response, Sequence[str]], activity: Optional[str]) -> None:
        """Open ``activity`` on the timeline for the tensors of ``what`` (None closes the
        current one).  Free when no timeline is recording."""
        timeline = self.timeline
        if not timeline.active:
            return
        names = what.names if isinstance(what, Response) else what
        for name in names:
            if activity is None:
                timeline.end(name)
            else:
                timeline.begin(name, activity)

    def finish(self, state: SetState, responses: List[Response], result=None,
               events: Optional[Dict[str, int]] = None) -> None:
        """Complete every tensor of ``responses`` (``events``: name -> completion
        cudaEvent_t) and record the responses for the cache.  The lookups are hoisted out of
        the loop: this runs once per tensor per step."""
        timeline = self.timeline
        pop, complete = state.entries.pop, self.handles.complete
        record = state.controller.record_executed
        for resp in responses:
            for name in resp.names:
                entry = pop(name, None)
                if timeline.active:
                    timeline.end(name)
                if entry is not None:
                    complete(entry.handle, None, result, events.get(name, 0) if events else 0)
                    record(resp, entry.signature)
                else:
                    record(resp, None)

    def fail(self, state: SetState, names: Sequence[str], error: str) -> None:
        for name in names:
            entry = state.entries.pop(name, None)
            if entry is not None:
                self.handles.complete(entry.handle, error=error)

    def notify(self) -> None:
        """Wake the waiters: called once per batch of completions."""
        self.handles.notify()

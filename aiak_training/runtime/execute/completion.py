"""The end of a lane-executed response on this rank: handles completed, timeline closed.

Both executors finish their responses through one :class:`Completer`, so a tensor completes
the same way whichever device it lives on.  The handles live in the C++ engine's table: a
result that is a Python object (an allgather's shape, a process set's id) is stored in
``results`` before the handle is marked done, so a waiter always finds it; the C++ thread wakes
the waiters when the lane returns.
"""
from typing import Any, Dict, List, Optional, Sequence, Union

from aiak_training.common.messages import Response
from aiak_training.common.timeline import Timeline
from aiak_training.runtime.entries import SetState


class Completer:
    def __init__(self, core: Any, timeline: Timeline, results: Dict[int, object]):
        self.core = core          # common.native.EngineCore
        self.timeline = timeline
        self.results = results    # handle -> result, read by Engine.wait

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
        cudaEvent_t).  A name without an entry here belongs to a rank that joined."""
        core, timeline, pop = self.core, self.timeline, state.entries.pop
        for resp in responses:
            for name in resp.names:
                entry = pop(name, None)
                if timeline.active:
                    timeline.end(name)
                if entry is None:
                    continue
                if result is not None:
                    self.results[core.handle_of(state.id, name)] = result
                core.finish_name(state.id, name, "", events.get(name, 0) if events else 0)

    def fail(self, state: SetState, names: Sequence[str], error: str) -> None:
        for name in names:
            if state.entries.pop(name, None) is not None:
                self.core.finish_name(state.id, name, error, 0)

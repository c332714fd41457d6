"""What the next training cycle runs: each run's next short operation, then one pass of forward_backward
work shared fairly across runs within a token budget.

`plan_cycle` picks the requests, `share_pass` does the arithmetic on token counts; both are pure: they
take nothing off the queues and know nothing about threads.
"""

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from server.scheduler.requests import TrainingRequest
from server.training.operations import ForwardBackward


@dataclass(frozen=True)
class PassShare:
    """A forward_backward request in a pass, and how many more of its datums the pass runs."""

    request: TrainingRequest
    num_datums: int


@dataclass(frozen=True)
class Cycle:
    """One cycle's plan: operations that run alone, then one pass (empty when no run has forward work)."""

    alone: list[TrainingRequest]
    """Each run's next request when it is not a forward_backward (optim_step, a save's copy, a load)."""
    passing: list[PassShare]
    """Requests of the pass, each run's in seq_id order; each is at the front of its run's queue."""
    served: list[str]
    """Runs with datums in the pass (they go to the back of the turn order)."""


def plan_cycle(ready: Mapping[str, deque[TrainingRequest]], last_served: Mapping[str, int], pass_tokens: int,
               pass_runs: int | None) -> Cycle:
    """The next cycle from each run's ready requests (non-empty queues, in order) and the pass in which each
    run last had datums (runs least recently served go first)."""
    alone, offers = [], []
    for model_id, lane in ready.items():
        if not isinstance(lane[0].operation, ForwardBackward):
            alone.append(lane[0])
        else:
            offers.append(model_id)
    if not offers:
        return Cycle(alone, [], [])
    offers.sort(key=lambda model_id: last_served.get(model_id, -1))
    offers = offers[:pass_runs]
    forward_only = ready[offers[0]][0].operation.forward_only
    streams = {}
    for model_id in offers:
        stream = []
        for request in ready[model_id]:
            operation = request.operation
            if not isinstance(operation, ForwardBackward) or operation.forward_only != forward_only:
                break
            stream.append(request)
        if stream:
            streams[model_id] = stream
    taken = share_pass([[tokens for request in stream for tokens in request.operation.datum_tokens()[request.done:]]
                        for stream in streams.values()], pass_tokens)
    passing, served = [], []
    for (model_id, stream), count in zip(streams.items(), taken):
        if count:
            served.append(model_id)
        for request in stream:
            if count == 0:
                break
            num_datums = min(count, len(request.operation.examples) - request.done)
            passing.append(PassShare(request, num_datums))
            count -= num_datums
    return Cycle(alone, passing, served)


def share_pass(offers: list[list[int]], budget: int) -> list[int]:
    """How many datums of each offer (its datums' token counts, offers in turn order) the pass takes.

    Every run with forward_backward (or forward) work ready offers its datums in seq_id order (those of
    its consecutive ready requests, laid end to end), least recently served first. The budget is shared
    out in two rounds: in the first each run gets up to an equal share (and at least its next datum while
    the budget has room for it), in the second the runs, in the same order, take what the others left.
    So a tenant's long request never holds another's small one for more than one pass: it gets its share
    now and goes on in the next pass, while a run alone fills the whole budget.

    The pass holds at least one datum, even if that one alone is over the budget.
    """
    taken = [0] * len(offers)
    used = 0
    share = budget // max(len(offers), 1)

    def fits(tokens: int) -> bool:
        return used == 0 or used + tokens <= budget

    for index, tokens in enumerate(offers):
        own = 0
        while taken[index] < len(tokens) and fits(tokens[taken[index]]) and (
                own == 0 or own + tokens[taken[index]] <= share):
            own += tokens[taken[index]]
            used += tokens[taken[index]]
            taken[index] += 1
    for index, tokens in enumerate(offers):
        while taken[index] < len(tokens) and fits(tokens[taken[index]]):
            used += tokens[taken[index]]
            taken[index] += 1
    return taken

"""Which ready forward_backward work goes into the next training pass: fair across runs, within a token budget.

Every run with forward_backward (or forward) work ready offers its datums in seq_id order (those of
its consecutive ready requests, laid end to end), and the runs are taken least recently served
first. The pass budget is shared out in two rounds: in the first each run gets up to an equal share
(and at least its next datum while the budget has room for it), in the second the runs, in the same
order, take what the others left. So a tenant's long request never holds another's small one for
more than one pass: it gets its share now and goes on in the next pass, while a run alone fills the
whole budget. Pure arithmetic on token counts; knows nothing about requests or threads.
"""


def share_pass(offers: list[list[int]], budget: int) -> list[int]:
    """How many datums of each offer (its datums' token counts, offers in turn order) the pass takes.

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

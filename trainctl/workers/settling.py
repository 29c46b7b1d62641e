"""Which ranks of a failed generation settle, and how long to wait for the rest.

After a rank dies, its peers' collectives raise and their calls return; `RankWorker.settle` answers True
once a rank's call has returned and its garbage is collected. A gloo rank can stay blocked in a collective
with a peer that has already returned: that peer's connections stay open after it destroyed its process
groups, and aborting the blocked rank's groups does not unblock gloo (both measured, docs/reliability.md),
so it would only return once its settle timeout runs out. `collect_settled` therefore stops waiting for
the ranks that have not answered `BLOCKED_GRACE` seconds after the last peer settled: the failure has
reached every rank by then, and a rank still in its call is blocked (it takes a spare or a fresh process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

BLOCKED_GRACE = 0.5
"""Seconds a rank that has not settled is waited for after the last of its peers settled."""


def collect_settled(
    replies: Mapping[Any, int],
    wait: Callable[[list[Any], float], list[Any]],
    settled: Callable[[Any], bool],
    timeout: float,
    grace: float = BLOCKED_GRACE,
    clock: Callable[[], float] = time.monotonic,
) -> list[int]:
    """The ranks whose settle reply (``replies``: reply -> rank) said True, in rank order.

    ``wait(pending, seconds)`` returns the replies that are ready within ``seconds`` (at least one, or
    none when the time ran out); ``settled(reply)`` reads one (False for a dead worker). Waits at most
    ``timeout`` seconds in all, and at most ``grace`` seconds after the newest True reply."""
    pending = dict(replies)
    kept: list[int] = []
    deadline = until = clock() + timeout
    while pending and (now := clock()) < until:
        ready = wait(list(pending), until - now)
        if not ready:
            break
        for reply in ready:
            rank = pending.pop(reply)
            if settled(reply):
                kept.append(rank)
                until = min(deadline, clock() + grace)
    return sorted(kept)

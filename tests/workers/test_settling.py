"""collect_settled: which ranks of a failed generation are kept, and how long it waits for the others."""

from __future__ import annotations

from trainctl.workers.settling import BLOCKED_GRACE, collect_settled


class Replies:
    """Settle replies that arrive at given times on a fake clock (None: never)."""

    def __init__(self, answers: dict[int, tuple[float | None, bool]]):
        self.now = 0.0
        self.answers = answers  # rank -> (time of the reply, its value)

    def clock(self) -> float:
        return self.now

    def wait(self, pending: list[int], seconds: float) -> list[int]:
        due = [r for r in pending if self.answers[r][0] is not None and self.answers[r][0] <= self.now + seconds]
        if not due:
            self.now += seconds
            return []
        first = min(self.answers[r][0] for r in due)
        self.now = max(self.now, first)
        return [r for r in due if self.answers[r][0] == first]

    def collect(self, timeout: float = 3.0) -> list[int]:
        return collect_settled({rank: rank for rank in self.answers}, self.wait, lambda r: self.answers[r][1],
                               timeout, clock=self.clock)


def test_every_rank_that_settles_is_kept_and_a_dead_one_is_not() -> None:
    replies = Replies({0: (0.2, True), 1: (0.01, False), 2: (0.3, True), 3: (0.25, True)})
    assert replies.collect() == [0, 2, 3]
    assert replies.now == 0.3


def test_a_rank_still_blocked_after_its_peers_settled_is_given_up_after_the_grace_not_the_timeout() -> None:
    replies = Replies({0: (0.2, True), 1: (None, True), 2: (0.01, False), 3: (0.35, True)})
    assert replies.collect(timeout=3.0) == [0, 3]
    assert replies.now == 0.35 + BLOCKED_GRACE


def test_a_rank_that_settles_within_the_grace_after_the_last_peer_is_kept() -> None:
    replies = Replies({0: (0.2, True), 1: (0.2 + 0.9 * BLOCKED_GRACE, True), 2: (0.01, False)})
    assert replies.collect() == [0, 1]


def test_the_grace_starts_at_a_settled_peer_not_at_a_dead_one() -> None:
    # The dead rank answers at once; the survivors take longer than the grace to settle (a loaded machine).
    replies = Replies({0: (0.0, False), 1: (1.2, True), 2: (1.4, True)})
    assert replies.collect() == [1, 2]


def test_when_no_rank_settles_it_waits_for_the_timeout() -> None:
    replies = Replies({0: (None, True), 1: (0.1, False)})
    assert replies.collect(timeout=3.0) == []
    assert replies.now == 3.0


def test_the_grace_runs_from_the_newest_settled_peer_not_from_a_later_dead_one() -> None:
    replies = Replies({0: (0.2, True), 1: (0.2 + 0.5 * BLOCKED_GRACE, False), 2: (None, True)})
    assert replies.collect() == [0]
    assert replies.now == 0.2 + BLOCKED_GRACE

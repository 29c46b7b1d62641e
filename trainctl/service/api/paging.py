"""The page size of a List RPC (ListJobs, ListSweeps): what the request asks, the default for 0, capped."""

from __future__ import annotations

from trainctl.wire.errors import bad_field

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


def page_size(requested: int) -> int:
    """The rows a page holds: `requested` (0: the default) up to MAX_PAGE_SIZE; a negative size is refused."""
    if requested < 0:
        raise bad_field("page_size", "must not be negative")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)

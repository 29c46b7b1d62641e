"""The database outage of the load benchmark: take the PostgreSQL server away under the load mix, watch
the service's health meanwhile, and judge the clients' answers against the outage's times.

`take_database_away` stops the server for real (fast shutdown: SIGINT to the postmaster's PID, which
ends its sessions) and starts it again on the same data directory and port; it must run on the thread
that started the server (the server's parent-death signal follows the thread that spawned it). The
times it returns are wall-clock seconds, as are the clients' call end times (they run in other
processes on the same machine).

`outage_summary` counts the answers that ended between the stop and the database accepting
connections again, by kind and code (and by method and code, split at the moment the server had
shut down); counts as unexpected every UNAVAILABLE answer outside the window
from the stop to `recovery_limit` seconds after the database accepts connections; and measures, from
that moment, the first OK answer of each method and the first expected answer of each request kind
(the kinds whose answer is an error, e.g. NOT_FOUND for another tenant's job, never answer OK), and
the first health check answering SERVING.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEALTH_POLL_SECONDS = 0.1
HEALTH_CHECK_DEADLINE = 5.0


class Database(Protocol):
    def stop(self) -> None: ...

    def start(self) -> None:
        """Returns once the server accepts connections."""


def take_database_away(database: Database, at: float, seconds: float) -> dict[str, float]:
    """At wall-clock time `at`, stop `database`; `seconds` after sending the stop, start it again. The
    wall-clock times of each step ("accepting": the start returned, a connection having succeeded)."""
    time.sleep(max(0.0, at - time.time()))
    stop_sent = time.time()
    database.stop()
    stopped = time.time()
    time.sleep(max(0.0, stop_sent + seconds - time.time()))
    start_sent = time.time()
    database.start()
    return {"stop_sent": stop_sent, "stopped": stopped, "start_sent": start_sent, "accepting": time.time()}


class HealthWatch:
    """Asks the service's gRPC health (the whole server, "") every HEALTH_POLL_SECONDS in a thread and
    records each change of answer as (wall-clock time the answer arrived, status or error code)."""

    def __init__(self, target: str):
        self._channel = grpc.insecure_channel(target)
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self.changes: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)

    def start(self) -> HealthWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        last = None
        while not self._stop.wait(HEALTH_POLL_SECONDS):
            try:
                answer = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_CHECK_DEADLINE)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
            except grpc.RpcError as exc:
                status = exc.code().name
            if status != last:
                self.changes.append((time.time(), status))
                last = status

    def stop(self) -> list[tuple[float, str]]:
        self._stop.set()
        self._thread.join(HEALTH_CHECK_DEADLINE + 1)
        self._channel.close()
        return self.changes


def _first_after(entries: list[tuple[float, str, str, bool]], since: float, accept: Any) -> float | None:
    """Seconds from `since` to the end of the first entry after it that `accept` takes (None: none)."""
    ends = [end for end, kind, code, bad in entries if end >= since and accept(kind, code, bad)]
    return round(min(ends) - since, 3) if ends else None


def outage_summary(
    parts: list[dict[str, Any]], times: dict[str, float], health: list[tuple[float, str]], recovery_limit: float,
) -> dict[str, Any]:
    """The clients' timelines judged against the outage's `times` (take_database_away's)."""
    timeline = sorted(entry for part in parts for entry in part["timeline"])
    methods: dict[str, str] = {}
    for part in parts:
        methods.update(part["methods"])
    began, accepting = times["stop_sent"], times["accepting"]
    started, finished = min(p["started"] for p in parts), max(p["finished"] for p in parts)
    during = [e for e in timeline if began <= e[0] <= accepting]
    shutting_down = [e for e in during if e[0] <= times["stopped"]]
    down = [e for e in during if e[0] > times["stopped"]]
    outside = [e for e in timeline if e[2] == "UNAVAILABLE" and not began <= e[0] <= accepting + recovery_limit]
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted(methods, key=lambda k: (methods[k], k)):
        codes = Counter(code for _, k, code, _ in during if k == kind)
        by_kind[kind] = {
            "method": methods[kind], "during_outage": dict(codes),
            "unexpected_during_outage": sum(1 for _, k, _, bad in during if k == kind and bad),
            "first_expected_answer_s": _first_after(
                timeline, accepting, lambda k, code, bad, kind=kind: k == kind and code != "UNAVAILABLE" and not bad),
            "last_unavailable_s": max((round(e[0] - accepting, 3) for e in timeline
                                       if e[1] == kind and e[2] == "UNAVAILABLE" and e[0] >= accepting), default=None),
        }
    by_method = {
        method: {
            "during_outage": dict(Counter(code for _, k, code, _ in during if methods[k] == method)),
            "first_ok_s": _first_after(timeline, accepting, lambda k, code, bad, method=method: methods[k] == method and code == "OK"),
        }
        for method in sorted(set(methods.values()))
    }
    serving = [t for t, status in health if t >= accepting and status == "SERVING"]
    not_serving = [t for t, status in health if began <= t <= accepting and status != "SERVING"]

    def rate(since: float, until: float) -> float:
        return round(sum(1 for e in timeline if since <= e[0] < until) / (until - since), 1)

    first_ok = [m["first_ok_s"] for m in by_method.values()]
    return {
        "outage_seconds": round(accepting - began, 2), "recovery_limit_s": recovery_limit,
        "started_after_load_s": round(began - started, 2),
        "stop_took_s": round(times["stopped"] - began, 3), "start_took_s": round(accepting - times["start_sent"], 3),
        "calls_per_second": {"before": rate(started, began), "during": rate(began, accepting),
                             "after": rate(accepting, finished)},
        "during_outage": dict(Counter(code for _, _, code, _ in during)),
        "while_shutting_down": dict(Counter(f"{methods[kind]} {code}" for _, kind, code, _ in shutting_down)),
        "while_down": dict(Counter(f"{methods[kind]} {code}" for _, kind, code, _ in down)),
        "unexpected_during_outage": sum(1 for e in during if e[3]),
        "unavailable_outside_window": len(outside),
        "health": {
            "not_serving_after_stop_s": round(min(not_serving) - began, 3) if not_serving else None,
            "serving_after_accepting_s": round(min(serving) - accepting, 3) if serving else None,
            "changes": [(round(t - started, 3), status) for t, status in health],
        },
        "by_method": by_method, "by_kind": by_kind,
        "recovered_within_limit": all(s is not None and s <= recovery_limit for s in first_ok),
    }


def outage_markdown(outage: dict[str, Any]) -> str:
    """Per method and per kind: answers during the outage, and the time to the first OK / expected answer."""
    rows = [
        f"database away {outage['outage_seconds']} s (stop {outage['stop_took_s']} s, start {outage['start_took_s']} s); "
        f"calls/s before / during / after: {outage['calls_per_second']}; during: {outage['during_outage']}; "
        f"unexpected during: {outage['unexpected_during_outage']}; UNAVAILABLE outside the window: "
        f"{outage['unavailable_outside_window']}; health {outage['health']['not_serving_after_stop_s']} s after "
        f"the stop not SERVING, SERVING {outage['health']['serving_after_accepting_s']} s after the database; "
        f"answers while the server shut down: {outage['while_shutting_down']}",
        "", "| method | request kind | answers during the outage | first OK / expected answer after, s |",
        "|---|---|---|---|",
    ]
    for method, m in outage["by_method"].items():
        rows.append(f"| **{method}** | all | {m['during_outage']} | {m['first_ok_s']} |")
        for kind, k in outage["by_kind"].items():
            if k["method"] == method:
                rows.append(f"| | {kind} | {k['during_outage']} | {k['first_expected_answer_s']} |")
    return "\n".join(rows)

"""The clock correction through the store: a real TCPStore, rank 0 and a leader in threads."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from ddpdoctor.measure import clock_offset


@pytest.fixture()
def store():
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    yield server


def _client(server):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10))


def _run(store, hosts, skew_s=0.0, serve=True):
    results = {}
    server = threading.Thread(target=lambda: results.update(silent=clock_offset.serve(store, 0, hosts, 5.0)))
    if serve:
        server.start()
    clients = []
    for rank in sorted(hosts):
        if rank == 0:
            continue
        client = _client(store)
        clock = (lambda: time.time() + skew_s) if hosts[rank] != hosts[0] else time.time
        t = threading.Thread(target=lambda r=rank, c=client, k=clock: results.__setitem__(
            r, clock_offset.measure(c, r, hosts, 1.0 if not serve else 5.0, clock=k)))
        t.start()
        clients.append(t)
    for t in clients:
        t.join(10)
    if serve:
        server.join(10)
    return results


def test_a_host_whose_clock_runs_ahead_is_measured_within_the_round_trip(store):
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    results = _run(store, hosts, skew_s=7.5)
    assert results["silent"] == []
    assert results[1].offset_s == 0.0 and results[1].source == "rank 0's host"
    leader, follower = results[2], results[3]
    assert abs(leader.offset_s - 7.5) <= leader.error_s + 0.005
    assert leader.error_s < 0.05
    # The other rank of that host takes its leader's figure instead of pinging again.
    assert follower.offset_s == leader.offset_s and "by rank 2" in follower.source


def test_a_clock_behind_gives_a_negative_offset(store):
    results = _run(store, {0: "a", 1: "b"}, skew_s=-3.25)
    assert abs(results[1].offset_s + 3.25) <= results[1].error_s + 0.005


def test_no_answer_from_rank_0_is_an_unknown_offset_within_the_deadline(store):
    started = time.monotonic()
    results = _run(store, {0: "a", 1: "b"}, serve=False)
    assert time.monotonic() - started < 5.0
    assert results[1].error_s == float("inf") and "did not answer" in results[1].source
    assert results[1].to_json()["offset_ms"] is None  # JSON has no infinity


def test_host_leaders_are_the_lowest_rank_per_host():
    assert clock_offset.host_leaders({3: "b", 0: "a", 2: "b", 1: "a"}) == {"a": 0, "b": 2}

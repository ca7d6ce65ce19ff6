"""The out-of-band channel: liveness and results travel beside the collectives.

Collectives are what breaks, so nothing the report needs goes through them. Every rank
writes JSON values into a c10d TCPStore served by a process that outlives the ranks
where one exists (our launcher, torchrun's agent) and by rank 0 elsewhere. Readers
never block without a deadline: they poll `check` and turn silence into a finding.

Keys (under the `ddpdoctor/` prefix):
  hello/<rank>      identity: host, pid, local rank, what it saw of the world
  hb/<rank>         heartbeat: wall time, stage, collective in flight
  timeline/<rank>   the stages this rank entered, with start/end and outcome
  result/<probe>/<rank>  a probe's facts from that rank
  error/<rank>      an exception that ended a stage on that rank
  timeout/<rank>    a stage deadline that expired on that rank, with its Python stack
  done/<rank>       this rank finished every stage
  terminated/<rank> this rank was stopped by SIGTERM (torchrun's agent, our launcher)
  bye/<rank>        this rank is leaving; rank 0 keeps a store it hosts up until all said it
  reporter_takeover counter: the first live rank to claim it reports when rank 0 is dead
  verdict           the exit code the reporter decided, for ranks that wait on it
"""

from __future__ import annotations

import builtins
import datetime
import json
import time
from typing import Any, Iterable, Optional

from ddpdoctor.core import keys
from ddpdoctor.core.run_record import RunRecord

PREFIX = "ddpdoctor"


def _store_module():
    import torch.distributed as dist  # deferred: importing torch costs seconds

    return dist


class Channel:
    def __init__(self, store: Any) -> None:
        self.raw = store
        self.store = _store_module().PrefixStore(PREFIX, store)

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float, *, is_master: bool = False,
                listen_fd: Optional[int] = None) -> "Channel":
        dist = _store_module()
        kwargs: dict[str, Any] = {"wait_for_workers": False}
        if listen_fd is not None:
            kwargs["master_listen_fd"] = listen_fd
        store = dist.TCPStore(host, port, None, is_master,
                              datetime.timedelta(seconds=timeout_s), **kwargs)
        return cls(store)

    def pg_store(self) -> Any:
        """The store init_process_group rendezvouses through, apart from our keys."""
        return _store_module().PrefixStore("pg", self.raw)

    def set(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value, default=_jsonable))

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def get(self, key: str) -> Any:
        """The value, or None if nobody wrote it: never blocks."""
        if not self.has(key):
            return None
        return json.loads(self.store.get(key).decode("utf-8"))

    def wait(self, keys: Iterable[str], timeout_s: float, poll_s: float = 0.05) -> builtins.set[str]:
        """Wait until every key exists or the deadline passes; returns those present.
        (`builtins.set`: in this class `set` names the method above.)"""
        pending = list(keys)
        present: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            for key in list(pending):
                if self.has(key):
                    present.add(key)
                    pending.remove(key)
            if not pending or time.monotonic() >= deadline:
                return present
            time.sleep(poll_s)

    def collect(self, pattern: str, ranks: Iterable[int]) -> dict[int, Any]:
        """{rank: value} for each rank that wrote `pattern.format(rank=r)`."""
        found = {}
        for rank in ranks:
            value = self.get(pattern.format(rank=rank))
            if value is not None:
                found[rank] = value
        return found


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def read_record(channel: Channel, record: RunRecord) -> RunRecord:
    """Copy every rank's published keys into `record` (never blocks)."""
    ranks = range(record.world_size)
    record.hellos.update(channel.collect(keys.HELLO_PATTERN, ranks))
    record.heartbeats.update(channel.collect(keys.HEARTBEAT_PATTERN, ranks))
    record.timelines.update(channel.collect(keys.TIMELINE_PATTERN, ranks))
    record.errors.update(channel.collect(keys.ERROR_PATTERN, ranks))
    record.timeouts.update(channel.collect(keys.TIMEOUT_PATTERN, ranks))
    record.done.update(channel.collect(keys.DONE_PATTERN, ranks))
    record.flight_recorder.update(channel.collect(keys.FLIGHT_RECORDER_PATTERN, ranks))
    for probe in record.probes:
        record.results.setdefault(probe, {}).update(channel.collect(keys.result_pattern(probe), ranks))
    record.ended = time.time()
    return record

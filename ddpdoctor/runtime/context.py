"""RankContext: everything a probe needs on one rank, built once per run.

Narrow on purpose: a probe reads the rank, the world, the device and backend, the settings, the
hellos every rank sent at the rendezvous (from rank 0's digest: never re-read from the store,
which at N ranks would be N² reads), and the typed `SharedState` other stages left; it marks its
stages and collectives, and publishes partial facts through `publish_partial`, the one writer of
its result keys.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

from ddpdoctor.core import keys
from ddpdoctor.core.hello import Hello
from ddpdoctor.runtime.channel import Channel
from ddpdoctor.runtime.config import CheckConfig
from ddpdoctor.runtime.inject import Injector
from ddpdoctor.runtime.launch_env import LaunchEnv
from ddpdoctor.runtime.liveness import Watchdog
from ddpdoctor.runtime.rank_state import RankState, StageRecord, Terminated


if TYPE_CHECKING:
    from ddpdoctor.measure.host_load import CpuSample
    from ddpdoctor.measure.peer_reach import ReachFrom
    from ddpdoctor.runtime.workload import WorkloadResult


@dataclass
class SharedState:
    """What one stage of a rank leaves for another on the same rank: typed, so a probe says what
    it reads instead of fishing in a dict."""

    # Every rank's hello from the rendezvous digest (session/rank.py's _rendezvous), by rank.
    hellos: dict[int, Hello] = field(default_factory=dict)
    # The shared DDP workload, run once by whichever probe needs it first (runtime/workload.py).
    workload: Optional["WorkloadResult"] = None
    # A node's first rank listens here for the other nodes' dials (measure/peer_reach.py); open
    # until the process ends, so a slower node's dial never meets a closed port.
    reach_listener: Optional[Any] = None
    # Where the other nodes may dial it, as the init-hang probe read it at the dial (peer_reach.ReachFrom).
    reach: Optional["ReachFrom"] = None
    # This host's CPU counters at the rank's start (local rank 0 only), for the foreign load.
    host_load_start: Optional["CpuSample"] = None
    # The folder NCCL writes its tuning log to when --nccl-algo asked for it; the allreduce probe
    # takes it (and removes it).
    nccl_tuning_dir: Optional[str] = None
    # When the scaling run last said it was alive (time.time()).
    scaling_beat: float = 0.0


class StageFailed(Exception):
    """A stage ended in an error that is already published; the rank skips to the end."""


@dataclass
class RankContext:
    env: LaunchEnv
    cfg: CheckConfig
    channel: Channel
    injector: Injector
    state: RankState
    watchdog: Watchdog
    backend: str = ""  # chosen at init
    device: Any = None  # torch.device once init has chosen it
    shared: SharedState = field(default_factory=SharedState)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def hellos(self) -> Mapping[int, Hello]:
        """Every rank's hello, from the rendezvous digest: read once, by rank 0, for everyone."""
        return self.shared.hellos

    def publish_partial(self, probe: str, facts: Any) -> None:
        """This rank's facts of `probe` so far (a Facts object or its JSON), under its result key.

        The only writer of `result/<probe>/<rank>`: a probe publishes what it has before a step
        that may hang or crash (the shared workload), and the session publishes the whole facts
        when collect returns, so the report has the measurements either way.
        """
        value = facts.to_json() if hasattr(facts, "to_json") else facts
        self.channel.set(keys.result(probe, self.rank), value)

    @contextlib.contextmanager
    def stage(self, name: str, deadline_s: Optional[float] = None, inject_as: Optional[str] = None) -> Iterator[None]:
        """Enter a named stage: published, deadline-armed, fault hooks applied.

        Stages nest (a probe holds its workload's stages); the watchdog guards the
        innermost, and the enclosing stage is re-armed when it ends.
        """
        outer = self.state.stage
        outer_started = self.state.stage_started
        record = StageRecord(name=name, started=time.time())
        self.state.failed_collective = None
        self.state.timeline.append(record)
        self.state.stage, self.state.stage_started = name, record.started
        self._publish_timeline()
        armed = deadline_s if deadline_s is not None else self.cfg.timeout_s
        self.watchdog.arm(name, armed)
        try:
            self.injector.at_stage(inject_as or name)
            yield
        except StageFailed:
            record.ended, record.status = time.time(), "error"
            raise
        except Exception as exc:
            if self.state.terminating:
                record.ended, record.status = time.time(), "stopped"
                raise Terminated() from exc
            record.ended, record.status = time.time(), "error"
            record.detail = f"{type(exc).__name__}: {exc}"
            self._publish(keys.error(self.rank), {
                "stage": name, "t": record.ended, "type": type(exc).__name__,
                "message": str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__,
                "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:],
                "collective": self.state.collective or self.state.failed_collective,
            })
            # No Flight Recorder read here: right after a backend error it once held the rank past
            # the launcher's SIGTERM (its C++ dump holds the GIL); the deadline path and the end read it.
            self.watchdog.disarm()
            self._publish_timeline()
            raise StageFailed(record.detail) from exc
        else:
            record.ended, record.status = time.time(), "ok"
        finally:
            self.state.stage, self.state.stage_started = outer, outer_started
            self.state.collective = None
            self._publish_timeline()
            if record.status == "ok" and outer not in ("launch", "end"):
                # Give the enclosing stage a fresh deadline for its remaining work.
                self.watchdog.arm(outer, self.cfg.timeout_s)
            else:
                self.watchdog.disarm()

    def progress(self) -> None:
        """A long measurement that is moving on (a benchmark's next size): a fresh deadline.

        The stage deadline catches a stuck step, not a long sweep of quick ones.
        """
        self.state.stage_started = time.time()
        self.watchdog.arm(self.state.stage, self.cfg.timeout_s)

    @contextlib.contextmanager
    def collective(self, op: str, **detail: Any) -> Iterator[None]:
        """Mark a wait on the other ranks, so a deadline can say who waited for whom."""
        self.state.collectives_entered += 1
        self.state.collective = {"op": op, "seq": self.state.collectives_entered, **detail}
        try:
            yield
        except BaseException:
            # The stage's error handler runs after this; keep what we were waiting in.
            self.state.failed_collective = self.state.collective
            raise
        finally:
            self.state.collective = None

    def _publish_timeline(self) -> None:
        self._publish(keys.timeline(self.rank), [s.to_json() for s in self.state.timeline])

    def _publish(self, key: str, value: Any) -> None:
        """Best effort: when the store itself is gone, the stage's outcome still decides the exit."""
        try:
            self.channel.set(key, value)
        except Exception:
            self.state.store_lost = True

"""Every key of the out-of-band store, built here and nowhere else.

Why one module: a key is a contract between the rank that writes it and the launcher, the
reporter or another rank that reads it, often in another process or on another node. Spelled
in several files, a typo or a renamed key is silent until a hang goes unreported. Writers and
readers both build keys with these functions; `*_PATTERN` are the `{rank}` templates that
`Channel.collect` fills in.

All keys live under the channel's `ddpdoctor/` prefix (runtime/channel.py lists them with what
each holds).
"""

from __future__ import annotations

HELLO_PATTERN = "hello/{rank}"
HEARTBEAT_PATTERN = "hb/{rank}"
TIMELINE_PATTERN = "timeline/{rank}"
ERROR_PATTERN = "error/{rank}"
TIMEOUT_PATTERN = "timeout/{rank}"
DONE_PATTERN = "done/{rank}"
FLIGHT_RECORDER_PATTERN = "fr/{rank}"

HELLO_DIGEST = "hellos/digest"  # rank 0's digest of every hello (or of who is missing)
VERDICT = "verdict"  # the exit code the reporter decided, for ranks that wait on it
REPORTER_TAKEOVER = "reporter_takeover"  # counter: the first live rank to claim it reports


def hello(rank: int) -> str:
    return HELLO_PATTERN.format(rank=rank)


def heartbeat(rank: int) -> str:
    return HEARTBEAT_PATTERN.format(rank=rank)


def timeline(rank: int) -> str:
    return TIMELINE_PATTERN.format(rank=rank)


def error(rank: int) -> str:
    return ERROR_PATTERN.format(rank=rank)


def timeout(rank: int) -> str:
    return TIMEOUT_PATTERN.format(rank=rank)


def done(rank: int) -> str:
    return DONE_PATTERN.format(rank=rank)


def flight_recorder(rank: int) -> str:
    return FLIGHT_RECORDER_PATTERN.format(rank=rank)


def terminated(rank: int) -> str:
    return f"terminated/{rank}"


def bye(rank: int) -> str:
    return f"bye/{rank}"


def result_pattern(probe: str) -> str:
    """`result/<probe>/{rank}`: one probe's facts, per rank."""
    return f"result/{probe}/{{rank}}"


def result(probe: str, rank: int) -> str:
    return result_pattern(probe).format(rank=rank)


def localise_pairs(rank: int) -> str:
    """The allreduce probe's ring-pair timings from one rank, read by every rank."""
    return f"localise/pairs/{rank}"


def clock_ping(rank: int, i: int) -> str:
    """measure/clock_offset.py's ping-pong with a node's leader: ping, pong, then the result."""
    return f"clock/{rank}/ping/{i}"


def clock_pong(rank: int, i: int) -> str:
    return f"clock/{rank}/pong/{i}"


def clock_result(rank: int) -> str:
    return f"clock/{rank}/result"


def scaling_beat(rank: int) -> str:
    """`ddpdoctor scaling`: a rank measuring a size says it is alive (the others sit it out)."""
    return f"scaling/beat/{rank}"


SCALING_STEPS = "scaling/steps"  # the step count rank 0 chose for every size


def scaling_size_done(size: int, rank: int) -> str:
    return f"scaling/done/{size}/{rank}"


def scaling_knob_done(index: int, rank: int) -> str:
    return f"scaling/knob/{index}/{rank}"


# The training callback's keys live on the user's job store (torchrun's or the process group's),
# not the channel's: the full key is written here, with its `ddpdoctor/` prefix.
def watch_arrived(rank: int) -> str:
    """`ddpdoctor.watch()`: this rank reached init_process_group (its host and pid)."""
    return f"ddpdoctor/watch/{rank}"


def watch_reported(rank: int) -> str:
    return f"ddpdoctor/watch/reported/{rank}"


def callback_host(rank: int) -> str:
    """`Doctor`: where this rank runs, JSON {"host", "cpus"}, read once by rank 0 for the findings' nodes
    and the CPU-contention verdict (ranks on the same cores)."""
    return f"ddpdoctor/host/{rank}"


def callback_pid(rank: int) -> str:
    """`Doctor`: this rank's pid and host (JSON), so a peer can tell it dead or frozen when it is silent."""
    return f"ddpdoctor/pid/{rank}"


def callback_left(rank: int) -> str:
    """`Doctor`: this rank's loop ended (close() ran), after the step written here."""
    return f"ddpdoctor/left/{rank}"


def callback_final(instance: int, rank: int) -> str:
    """`Doctor`: this rank's last window at the end of the run (callback/final_check.py), JSON floats; `instance`
    counts the Doctors this process made (a second fit has keys of its own)."""
    return f"ddpdoctor/final/{instance}/{rank}"


def callback_final_replica(instance: int, rank: int, part: str) -> str:
    """`Doctor`: this rank's replica at the end of the run (callback/replicas.py, `end_payload`): `part` is
    "fingerprint" (one hash, read for every rank) or "detail" (read only where the fingerprints differ)."""
    return f"ddpdoctor/final/{instance}/{rank}/replica/{part}"


def callback_hang(episode: int, rank: int) -> str:
    """`Doctor`: this rank's record of the hang (callback/hang.py's RankRecord, JSON)."""
    return f"ddpdoctor/hang/{episode}/{rank}"


def callback_hang_started(episode: int) -> str:
    """`Doctor`: some rank began the hang's exchange; a rank between steps answers too."""
    return f"ddpdoctor/hang/{episode}/started"


def callback_hang_verdict(episode: int) -> str:
    """`Doctor`: the lowest answering rank's verdict (callback/hang.py's Verdict, JSON)."""
    return f"ddpdoctor/hang/{episode}/verdict"


def callback_hang_reported(episode: int, rank: int) -> str:
    """`Doctor`: this rank has written the verdict down; the culprit may leave."""
    return f"ddpdoctor/hang/{episode}/reported/{rank}"


def callback_hang_leaving(episode: int, rank: int) -> str:
    """`Doctor`: this culprit is leaving now; its victims, on other hosts, leave after it."""
    return f"ddpdoctor/hang/{episode}/leaving/{rank}"

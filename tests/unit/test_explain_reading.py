"""Reading logs for `explain`: prefixes, files and folders, gzip, damage, hostile input."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpdoctor.core.errors import UsageError
from ddpdoctor.explain.command import explain
from ddpdoctor.judge.flight_recorder import compare, read_dumps
from ddpdoctor.explain.prefixes import line_time, split_prefixes
from ddpdoctor.explain.read import discover, rank_from_name, read_chunks
from ddpdoctor.explain.scan import scan
from ddpdoctor.explain.signatures import BY_ID, SIGNATURES, match_line, trigger_words


@pytest.mark.parametrize("line, rank, local_rank, host, message", [
    ("[rank3]: ValueError: x", 3, None, None, "ValueError: x"),
    ("[default1]:[rank1]: ValueError: x", 1, 1, None, "ValueError: x"),
    ("[trainer2]: hello", None, 2, None, "hello"),
    ("12: RuntimeError: boom", 12, None, None, "RuntimeError: boom"),
    ("  3: [rank3]: hi", 3, None, None, "hi"),
    ("node07:1234:1240 [3] NCCL WARN NET/IB : oops", None, None, "node07", "node07:1234:1240 [3] NCCL WARN NET/IB : oops"),
    ("[rank5]:node07:1234:1240 [5] NCCL INFO x", 5, None, "node07", "node07:1234:1240 [5] NCCL INFO x"),
    ("[E1023 12:00:01.5 ProcessGroupNCCL.cpp:1] [Rank 6] Watchdog", 6, None, None,
     "[E1023 12:00:01.5 ProcessGroupNCCL.cpp:1] [Rank 6] Watchdog"),
    # a subgroup's rank is not the job's rank
    ("[PG ID 2 PG GUID 2 Rank 0] Watchdog", None, None, None, "[PG ID 2 PG GUID 2 Rank 0] Watchdog"),
    ("[PG ID 0 PG GUID 0(default_pg) Rank 4] Watchdog", 4, None, None, "[PG ID 0 PG GUID 0(default_pg) Rank 4] Watchdog"),
])
def test_prefixes_name_who_printed_the_line(line: str, rank, local_rank, host, message) -> None:
    origin, text = split_prefixes(line)
    assert (origin.rank, origin.local_rank, origin.host, text) == (rank, local_rank, host, message)


def test_timestamps_order_glog_and_iso_lines_alike() -> None:
    glog = line_time("E1123 09:19:03.755000 2666 api.py:1002] failed")
    bracketed = line_time("[W1123 09:19:04.000000000 socket.cpp:1] x")
    iso = line_time("2026-11-23 09:19:05,100 INFO x")
    assert glog is not None and bracketed is not None and iso is not None
    assert glog < bracketed < iso
    assert line_time("no time here") is None


@pytest.mark.parametrize("name, rank", [("rank3.log", 3), ("nccl_trace_rank_12", 12), ("worker-7.out", 7),
                                        ("job.log", None), ("task_0.txt", 0)])
def test_rank_from_file_name(name: str, rank) -> None:
    assert rank_from_name(name) == rank


def test_every_signature_can_be_found_by_the_trigger_pass() -> None:
    words = trigger_words()
    for sig in SIGNATURES:
        for trigger in sig.triggers:
            assert any(w in trigger for w in words), (sig.id, trigger)


def test_a_label_drops_the_fields_a_line_did_not_have() -> None:
    sig = BY_ID["gloo_peer_closed"]
    assert sig.describe({}) == "connection closed by peer"
    assert sig.describe({"peer": "10.0.0.2"}) == "connection closed by peer (10.0.0.2)"


def test_specific_signatures_win_over_the_generic_exception() -> None:
    sig, _ = match_line("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6528. GLHF")
    assert sig.id == "gloo_peer_closed"
    sig, fields = match_line("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a "
                             "total capacity of 79.10 GiB of which 1.06 GiB is free.")
    assert sig.id == "cuda_oom" and fields["gpu"] == "3" and fields["tried"] == "2.00 GiB"
    sig, fields = match_line("KeyError: 'label'")
    assert sig.id == "python_exception" and fields["type"] == "KeyError"


def test_chunks_end_on_lines_and_lose_nothing(tmp_path: Path) -> None:
    lines = [f"line {i} " + "x" * (i % 50) for i in range(5000)]
    path = tmp_path / "a.log"
    path.write_text("\n".join(lines))  # no newline at the end
    (log,) = discover([str(path)]).logs
    problems: list[str] = []
    chunks = list(read_chunks(log, problems, chunk_bytes=1000))
    assert len(chunks) > 10
    assert all(c.endswith("\n") for c in chunks[:-1])
    assert "".join(chunks) == path.read_text()
    assert problems == []


def test_line_numbers_are_right_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ddpdoctor.explain.read as reader

    monkeypatch.setattr(reader, "CHUNK_BYTES", 256)
    body = [f"[rank0]: step {i}" for i in range(400)]
    body[333] = "[rank1]: ValueError: the one"
    (tmp_path / "a.log").write_text("\n".join(body) + "\n")
    result = scan(discover([str(tmp_path / "a.log")]).logs)
    (event,) = result.events
    assert event.where == "a.log:334" and event.rank == 1
    assert result.lines == 400


def test_a_cut_gzip_is_explained_as_far_as_it_goes(tmp_path: Path) -> None:
    text = "".join(f"[rank0]: step {i}\n" for i in range(20000)) + "[rank1]: ValueError: late\n"
    data = gzip.compress(("[rank2]: KeyError: early\n" + text).encode())
    (tmp_path / "job.log.gz").write_bytes(data[: len(data) // 2])
    run = explain([str(tmp_path / "job.log.gz")])
    assert any(f.code == "RUN003" and f.ranks == (2,) for f in run.explanation.findings)
    assert any("read only in part" in n for n in run.notes)


def test_folders_are_walked_and_binaries_skipped(tmp_path: Path) -> None:
    (tmp_path / "logs" / "sub").mkdir(parents=True)
    (tmp_path / "logs" / "rank0.log").write_text("fine\n")
    (tmp_path / "logs" / "sub" / "rank1.log").write_text("ValueError: x\n")
    (tmp_path / "logs" / "core.bin").write_bytes(b"\x7fELF\x00\x00\x01")
    inputs = discover([str(tmp_path / "logs")])
    assert [log.rank_hint for log in inputs.logs] == [0, 1]
    assert inputs.skipped and "core.bin" in inputs.skipped[0]
    run = explain([str(tmp_path / "logs")])
    assert run.explanation.findings[0].ranks == (1,)  # the file name says whose it is


@pytest.mark.parametrize("make, words", [
    (lambda p: None, ["no such file"]),
    (lambda p: p.mkdir(), ["holds no files"]),
])
def test_bad_paths_are_one_line_errors(tmp_path: Path, make, words) -> None:
    target = tmp_path / "x"
    make(target)
    with pytest.raises(UsageError) as err:
        discover([str(target)])
    assert all(w in str(err.value) for w in words)


def test_unreadable_file_is_a_usage_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    path = tmp_path / "a.log"
    path.write_text("x")
    path.chmod(0)
    with pytest.raises(UsageError, match="permission denied"):
        discover([str(path)])


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED_BY_DUMP",))


def test_a_malicious_dump_is_refused_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    payload = pickle.dumps({"version": "2.10", "entries": [_Boom()], "pg_config": {}}, protocol=4)
    (tmp_path / "nccl_trace_rank_0").write_bytes(payload)
    dumps = read_dumps(discover([str(tmp_path / "nccl_trace_rank_0")]).dumps)
    assert not (tmp_path / "PWNED_BY_DUMP").exists()
    assert dumps.dumps == {}
    assert "refused" in dumps.problems[0] and "posix.system" in dumps.problems[0] or "system" in dumps.problems[0]


def _entry(seq: int, op: str = "all_reduce", shape=(8,), dtype: str = "Float", state: str = "completed") -> dict:
    return {"collective_seq_id": seq, "profiling_name": f"nccl:{op}", "process_group": ["0", "default_pg"],
            "input_sizes": [list(shape)], "input_dtypes": [dtype], "output_sizes": [list(shape)], "state": state,
            "is_p2p": False}


def _write_dumps(tmp_path: Path, per_rank: dict[int, list[dict]]) -> list[str]:
    paths = []
    for rank, entries in per_rank.items():
        path = tmp_path / f"nccl_trace_rank_{rank}"
        path.write_bytes(pickle.dumps({"version": "2.10", "pg_config": {}, "entries": entries}))
        paths.append(str(path))
    return paths


def test_ring_buffers_are_compared_only_where_all_ranks_still_hold_entries(tmp_path: Path) -> None:
    paths = _write_dumps(tmp_path, {0: [_entry(s) for s in range(3, 11)], 1: [_entry(s) for s in range(6, 11)]})
    mismatches, agreements = compare(read_dumps(discover(paths).dumps))
    assert mismatches == [] and (agreements[0].first_seq, agreements[0].last_seq) == (6, 10)


def test_a_dtype_difference_in_the_dumps_names_the_odd_rank(tmp_path: Path) -> None:
    per_rank = {r: [_entry(s) for s in range(1, 5)] + [_entry(5, dtype="Double" if r == 2 else "Float", state="started")]
                for r in range(4)}
    run = explain(_write_dumps(tmp_path, per_rank))
    (finding,) = run.explanation.findings
    assert finding.code == "RUN009" and finding.ranks == (2,)
    assert "Double" in finding.evidence["collective_by_rank"]["2"]


def test_a_dump_without_a_rank_in_its_name_is_a_note(tmp_path: Path) -> None:
    path = tmp_path / "dump.pkl"
    path.write_bytes(pickle.dumps({"entries": [], "pg_config": {}}))
    run = explain([str(path)])
    assert any("says no rank" in n for n in run.notes)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(
    st.text(max_size=120),
    st.sampled_from(["[rank1]: RuntimeError: x", "Detected mismatch between collectives on ranks. Rank 0",
                     "WorkNCCL(SeqNum=x, OpType=", "rank      : 9 (local_rank: x)", "srun: error: n1: task 3-1: Killed",
                     "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=A, Timeout(ms)=1)",
                     "global_world_sizes=[,,]", "Timed out after 5 seconds waiting for clients. 9/3 clients joined",
                     "\x00\ud7ff", "failed (exitcode: -9) local_rank: 0 (pid: 1) of binary"])),
    max_size=30))
def test_any_text_is_explained_without_crashing(tmp_path_factory, lines: list[str]) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "job.log"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    run = explain([str(path)])
    assert run.explanation.findings
    assert run.to_json()["exit_code"] in (0, 1, 2)


@pytest.mark.parametrize("stamp, month, day", [("E429", 4, 29), ("E0429", 4, 29), ("W105", 1, 5), ("E1123", 11, 23)])
def test_torchs_unpadded_month_is_read_as_glogs_padded_one(stamp: str, month: int, day: int) -> None:
    # torch's own c10 logger writes `[E429 08:46:24.8 ...]` for April 29; glog writes E0429.
    assert line_time(f"[{stamp} 08:46:24.5 ProcessGroupNCCL.cpp:1] x") == \
        line_time(f"2026-{month:02d}-{day:02d} 08:46:24.5 x")


def test_the_same_nccl_words_from_two_processes_stay_two_events(tmp_path: Path) -> None:
    # One failing link: both ends print the same warning; which rank each pid is comes from INFO lines later.
    log = tmp_path / "job.log"
    log.write_text("n1:100:101 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 busId 1000 - Init COMPLETE\n"
                   "n1:200:201 [1] NCCL INFO comm 0x2 rank 1 nranks 2 cudaDev 1 busId 2000 - Init COMPLETE\n"
                   "n1:100:102 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=12\n"
                   "n1:200:202 [1] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=12\n")
    run = explain([str(log)])
    assert [s.rank for s in run.explanation.ranks if s.first is not None] == [0, 1]
    first = run.explanation.findings[0]
    assert first.ranks == (0, 1) and set(first.evidence["first_error"]) == {"0", "1"}

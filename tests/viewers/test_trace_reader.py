"""Our timelines read by a reader that is not ours: Chrome DevTools' trace model (@paulirish/trace_engine, the
code DevTools' Performance panel loads traces with), run under node (tests/trace_reader; .ci/run installs it
with `npm ci`). What it built from the file is compared with what we meant to write: the nodes as processes,
the ranks as threads, each span's name, start and length.

Its limits, measured (tests/trace_reader/package.json's version): it checks none of the format's rules
(tests/trace_format.py does), and it reads no lowercase "i" instant (the format's own spelling; Perfetto and
chrome://tracing read them): the findings' markers are checked on the file itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ddpdoctor.render import trace_check

READER = Path(__file__).resolve().parents[1] / "trace_reader"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (READER / "node_modules" / "@paulirish" / "trace_engine").is_dir(),
    reason="the trace reader is not installed: `npm ci --prefix tests/trace_reader` (.ci/run does)")


def _read(path: Path) -> dict:
    done = subprocess.run(["node", str(READER / "read_trace.mjs"), str(path)], capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize("report", ["gpu_runs/h100x1_check_all.json", "trace/check_frozen_rank1.json",
                                    "allreduce/bench-2rank-gloo-pairs.json", "trace/bench_tbf_node3.json",
                                    "trace/check_preempt_rank1.json"])
def test_devtools_reads_our_nodes_ranks_and_every_span_as_we_wrote_them(tmp_path, report):
    doc = trace_check.from_report(json.loads((FIXTURES / report).read_text())).to_json()
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    read = _read(path)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    nodes = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {p["pid"]: p["name"] for p in read["processes"]} == nodes
    ours = sorted((e["pid"], e["tid"], e["name"], e["ts"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X")
    theirs = sorted((p["pid"], t["tid"], e["name"], e["ts"], e["dur"]) for p in read["processes"]
                    for t in p["threads"] for e in t["events"] if e["ph"] == "X")
    assert theirs == ours
    threads = {(p["pid"], t["tid"]): t["name"] for p in read["processes"] for t in p["threads"]}
    assert all(threads[where] == names[where] for where in threads), (threads, names)

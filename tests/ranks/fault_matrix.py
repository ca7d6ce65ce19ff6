"""The fault matrix: every stage of a run x every way a run breaks, and what each must give.

One cell is one real `ddpdoctor check` on 2 gloo CPU ranks with one injected fault on
rank 1: a crash (`os._exit`), a hang, SIGKILL, a real out-of-memory (an allocation over
its memory limit), or Ctrl-C / `kill` of the launcher (sent by rank 1 at that stage, so the signal
lands exactly there). What every cell must show is the same: ddpdoctor exits within its
deadline with a non-zero code, writes a report that names the fault and keeps what was
measured before it, and leaves no process or port behind. `check_cell` says it once.

`docs/fault-matrix.md` is generated from the results (see `write_doc`), by
`python -m pytest tests/ranks/test_fault_matrix.py -m "slow or not slow" --write-fault-matrix`.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

TIMEOUT = 5  # each stage's deadline in the matrix runs
# Starting 3 Python processes that import torch on 2 busy cores, before the first stage.
STARTUP_S = 25
# The slowest cell: a hang that only its own deadline ends, one stage deadline after startup,
# with the launcher's grace for a failed run on top. A cell over this has hung somewhere.
WALL_LIMIT_S = STARTUP_S + 2 * TIMEOUT + 10


@dataclass(frozen=True)
class Row:
    """A stage of a run, and the probes that take a run there (the cheapest set)."""
    stage: str
    what: str
    probes: str
    measured_before: tuple[str, ...] = ()  # probes whose results must survive the fault


ROWS: tuple[Row, ...] = (
    Row("launch", "process start, before torch is imported or the store dialled", "init-hang"),
    Row("rendezvous", "every rank says hello through the store", "init-hang"),
    Row("init", "init_process_group", "init-hang"),
    Row("probe:init-hang", "probe init-hang", "init-hang,topology"),
    Row("probe:topology", "probe topology (NVML, sysfs, links under load)", "init-hang,topology", ("init-hang",)),
    Row("probe:gpu-count", "probe gpu-count (device facts, then the shared DDP workload)", "topology,gpu-count",
        ("topology",)),
    Row("probe:homogeneity", "probe homogeneity (versions, matmul speed)", "topology,homogeneity", ("topology",)),
    Row("ddp", "DDP construction and its broadcast (in ddp-smoke)", "topology,ddp-smoke", ("topology",)),
    Row("train", "DDP training steps (in ddp-smoke)", "topology,ddp-smoke", ("topology",)),
    Row("verify", "the weights compared across ranks (in ddp-smoke)", "topology,ddp-smoke", ("topology",)),
    Row("report", "every rank done; the report gathered and written", "init-hang,topology",
        ("init-hang", "topology")),
)

FAULTS: tuple[str, ...] = ("crash", "hang", "kill", "oom", "sigint", "sigterm")
FAULT_WORDS = {
    "crash": "rank crash (exit 86, no cleanup)",
    "hang": "rank hang (sleeps forever)",
    "kill": "rank killed by SIGKILL",
    "oom": "rank out of memory (an allocation over its memory limit fails)",
    "sigint": "launcher SIGINT (Ctrl-C)",
    "sigterm": "launcher SIGTERM (kill)",
}
FAULTY_RANK = 1


# The cells the default test run takes: every fault once, in the stage where it is cheapest to
# run, and the out-of-memory a second time at launch (outside any stage, it takes a path of its
# own: the launcher, not the watchdog, names it). The whole matrix is 66 runs, about 8 minutes on
# 2 cores, more than the default suite's budget (issue 40: the suite within 10 minutes): the
# other cells are the slow tier (`-m slow`). Why each left-out cell may go: an injected fault
# takes the same injection, launcher and judging code at every stage (the watchdog's stage name
# is the only difference, and tests/unit/test_watchdog_record.py holds it), so a left-out cell's
# fault path is crossed by test_fault_cell's default cell of that fault:
#   crash: ("probe:topology", "crash") (and the torchrun reporter crash,
#          tests/ranks/test_launch_modes.py::test_torchrun_names_the_crashed_rank_even_when_it_is_the_reporter)
#   hang: ("train", "hang");  kill: ("probe:init-hang", "kill");  sigint: ("report", "sigint")
#   oom: ("launch", "oom"), ("probe:homogeneity", "oom");  sigterm: ("probe:gpu-count", "sigterm")
# The stages left out of the default tier (rendezvous, init, ddp, verify) are crossed by every
# default check that runs them (tests/ranks/test_check_e2e.py::test_healthy_run_gives_no_false_alarm).
# tests/unit/test_fault_matrix_doc.py holds this set to every fault, and docs/fault-matrix.md stars it.
DEFAULT_CELLS = frozenset({
    ("launch", "oom"), ("probe:init-hang", "kill"), ("probe:topology", "crash"), ("probe:gpu-count", "sigterm"),
    ("probe:homogeneity", "oom"), ("train", "hang"), ("report", "sigint"),
})


def default_cells() -> frozenset[tuple[str, str]]:
    return DEFAULT_CELLS


def argv(row: Row, fault: str) -> list[str]:
    return ["--nproc", "2", "--timeout", str(TIMEOUT), "--probes", row.probes,
            "--inject", f"{fault}:rank={FAULTY_RANK}:stage={row.stage}"]


def naming_finding(report: dict[str, Any], row: Row, fault: str) -> Optional[dict[str, Any]]:
    """The finding that names this cell's fault, or None: the heart of each cell's check."""
    findings = report.get("findings", [])

    def one(code: str) -> list[dict[str, Any]]:
        return [f for f in findings if f["code"] == code]

    if fault in ("sigint", "sigterm"):
        sig = fault.upper()
        hits = [f for f in one("RUN006") if f["evidence"].get("signal") == sig]
        return hits[0] if hits and report.get("interrupted") == sig else None
    if fault == "hang" and row.stage == "launch":
        # Stuck before it ever reached the store: to its peers, a rank that never arrived.
        hits = [f for f in one("RUN001") if f["ranks"] == [FAULTY_RANK]]
        return hits[0] if hits else None
    if fault == "hang":
        # Its stack shows where it is stuck (the injected hang, not our own threads); where rank 0
        # waited for it inside a collective, rank 0 is its victim, not a second culprit.
        hits = [f for f in one("RUN004") if f["ranks"] == [FAULTY_RANK] and f["evidence"]["stage"] == row.stage
                and f["evidence"]["deadline_s"] == TIMEOUT
                and "_hang_forever" in "\n".join(f["evidence"]["python_stack"])
                and "ddpdoctor-heartbeat" not in "\n".join(f["evidence"]["python_stack"])
                and (row.stage not in ("init", "ddp", "train") or "0" in f["evidence"]["affected_ranks"])]
        return hits[0] if hits else None
    crashes = [f for f in one("RUN002") + one("RUN003")
               if f["ranks"] == [FAULTY_RANK] and f["evidence"]["stage"] == row.stage
               and f["evidence"].get("injected") is True]
    if fault == "crash":
        hits = [f for f in crashes if f["code"] == "RUN002" and f["evidence"].get("exit_code") == 86
                and f"injected crash on rank {FAULTY_RANK}" in "\n".join(f["evidence"].get("last_output", []))]
    elif fault == "kill":
        hits = [f for f in crashes if f["code"] == "RUN002" and f["evidence"].get("signal") == "SIGKILL"]
    else:  # oom: a Python MemoryError inside a stage (RUN003), or before any stage (RUN002)
        hits = [f for f in crashes if f["evidence"].get("out_of_memory") is True and "out of memory" in f["title"]]
    return hits[0] if hits else None


@dataclass
class CellResult:
    stage: str
    fault: str
    passed: bool = False
    exit_code: Optional[int] = None
    wall_s: Optional[float] = None
    finding: str = ""
    problems: list[str] = field(default_factory=list)
    ran_at: str = ""
    # One verdict first (issue 37): the report's first warning-or-worse finding, and the one it led with
    # under the order reports had before the causal order (worst first, the run's own findings first).
    lead: str = ""
    lead_before: str = ""


SEVERITY_RANK = {"critical": 3, "warn": 2, "info": 1, "ok": 0}


def leads(report: dict[str, Any]) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]:
    """(the finding the report leads with, the one it led with before the causal order): warnings or worse."""
    serious = [f for f in report.get("findings", []) if SEVERITY_RANK.get(f["severity"], 0) >= 2]
    if not serious:
        return None, None
    before = sorted(serious, key=lambda f: (-SEVERITY_RANK[f["severity"]], f["probe"] != "run", f["code"]))[0]
    return serious[0], before


def check_cell(run: Any, row: Row, fault: str) -> CellResult:
    """Every rule a cell must keep, as a list of broken ones (empty: the cell passes)."""
    result = CellResult(row.stage, fault, exit_code=run.returncode, wall_s=round(run.wall_s, 1),
                        ran_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    problems = result.problems
    expected_exit = 3 if fault in ("sigint", "sigterm") else 2
    if run.returncode != expected_exit:
        problems.append(f"exit code {run.returncode}, expected {expected_exit}")
    if run.wall_s > WALL_LIMIT_S:
        problems.append(f"took {run.wall_s:.1f}s, over the {WALL_LIMIT_S}s deadline budget")
    if "Traceback" in run.stderr:
        problems.append("a traceback on ddpdoctor's stderr")
    report = run.report
    if report is None:
        problems.append("no JSON report written")
    else:
        if report.get("injected_faults") != [f"{fault}:rank={FAULTY_RANK}:stage={row.stage}"]:
            problems.append(f"injected_faults is {report.get('injected_faults')}")
        named = naming_finding(report, row, fault)
        if named is None:
            problems.append("no finding names the fault: " + "; ".join(
                f"{f['code']} {f['title']}" for f in report.get("findings", []) if f["severity"] != "ok"))
        else:
            result.finding = f"{named['code']}: {named['title']}"
        lead, before = leads(report)
        result.lead = f"{lead['code']} rank {lead['ranks']}" if lead else ""
        result.lead_before = f"{before['code']} rank {before['ranks']}" if before else ""
        if named is not None and (lead is None or (lead["code"], lead["ranks"]) != (named["code"], named["ranks"])):
            problems.append(f"the report leads with {result.lead or 'nothing'}, not with the fault's {named['code']}")
        if lead is not None and not str(report.get("verdict_line", "")).startswith(lead["code"]):
            problems.append(f"the verdict line does not name the lead {lead['code']}: {report.get('verdict_line')!r}")
        # RUN006 (interrupted) lists every rank it stopped: a fact, not blame.
        blamed = {r for f in report.get("findings", []) if f["severity"] == "critical" and f["probe"] == "run"
                  and f["code"] != "RUN006" for r in f["ranks"]}
        if blamed - {FAULTY_RANK}:
            problems.append(f"ranks {sorted(blamed - {FAULTY_RANK})} blamed besides rank {FAULTY_RANK}")
        for name in row.measured_before:
            section = next((p for p in report.get("probes", []) if p["name"] == name), None)
            if section is None or str(FAULTY_RANK) not in section.get("facts", {}):
                problems.append(f"probe {name}'s results from rank {FAULTY_RANK}, measured before the fault, are lost")
    result.passed = not problems
    return result


def results_dir(root: Path) -> Path:
    return root / "fault-matrix"


def save(result: CellResult, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{result.stage.replace(':', '_')}--{result.fault}.json"
    (directory / name).write_text(json.dumps(asdict(result), indent=1))


def load(directory: Path) -> dict[tuple[str, str], CellResult]:
    out = {}
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        out[(data["stage"], data["fault"])] = CellResult(**data)
    return out


def render_doc(results: dict[tuple[str, str], CellResult]) -> str:
    """docs/fault-matrix.md: the matrix as pass/fail per cell, then what each cell showed."""
    lines = [
        "# Fault matrix",
        "",
        "<!-- Generated by tests/ranks/test_fault_matrix.py (--write-fault-matrix); do not edit by hand. -->",
        "",
        "Every stage of a `ddpdoctor check` run x every way a run breaks. Each cell is a real run",
        f"on 2 gloo CPU ranks with `--timeout {TIMEOUT}` and one fault injected on rank {FAULTY_RANK}",
        "(`--inject KIND:rank=1:stage=STAGE`, see [fire-drill.md](fire-drill.md)). A cell passes",
        "when ddpdoctor exits with the expected code (2, or 3 for a signal to the launcher) within",
        f"{WALL_LIMIT_S} s, prints no traceback, writes a JSON report whose findings name the fault",
        "(and blame no other rank), keeps the results measured before the fault, and leaves no",
        "process or port behind.",
        "",
        "Regenerate: `python -m pytest tests/ranks/test_fault_matrix.py -m \"slow or not slow\" "
        "--write-fault-matrix`.",
        f"The default test run takes {len(default_cells())} of the {len(ROWS) * len(FAULTS)} cells "
        "(marked *); the others are the slow tier.",
        "",
        "| stage | " + " | ".join(FAULTS) + " |",
        "|---|" + "---|" * len(FAULTS),
    ]
    default = default_cells()
    for row in ROWS:
        cells = []
        for fault in FAULTS:
            r = results.get((row.stage, fault))
            mark = "not run" if r is None else ("pass" if r.passed else "**FAIL**")
            if r is not None and r.wall_s is not None:
                mark += f" ({r.wall_s:.0f} s)"
            cells.append(mark + (" *" if (row.stage, fault) in default else ""))
        lines.append(f"| `{row.stage}` | " + " | ".join(cells) + " |")
    passed = sum(1 for r in results.values() if r.passed)
    lines += ["", f"{passed} of {len(results)} cells run passed; {len(ROWS) * len(FAULTS) - len(results)} not run.",
              "", "## Stages", ""]
    lines += [f"- `{row.stage}`: {row.what} (`--probes {row.probes}`)" for row in ROWS]
    lines += ["", "## Faults", ""]
    lines += [f"- `{fault}`: {FAULT_WORDS[fault]}" for fault in FAULTS]
    lines += ["", "## What each cell reported", "",
              "The report's lead is its first warning-or-worse finding (the verdict line names it); *before* is",
              "the one it led with under the order reports had before the causal order (issue 37): worst first,",
              "the run's own findings first. A cell fails when its report does not lead with the fault.", "",
              "| stage | fault | exit | leads with (before) | finding |", "|---|---|---|---|---|"]
    for row in ROWS:
        for fault in FAULTS:
            r = results.get((row.stage, fault))
            if r is None:
                continue
            said = r.finding.replace("|", "\\|") if r.passed else "FAIL: " + "; ".join(r.problems).replace("|", "\\|")
            lead = f"{r.lead} ({r.lead_before})" if r.lead_before and r.lead_before != r.lead else r.lead
            lines.append(f"| `{row.stage}` | {fault} | {r.exit_code} | {lead} | {said} |")
    stamps = sorted(r.ran_at for r in results.values() if r.ran_at)
    if stamps:
        lines += ["", f"Runs from {stamps[0]} to {stamps[-1]}, on a 2-core VM."]
    return "\n".join(lines) + "\n"

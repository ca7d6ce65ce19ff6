"""docs/fault-matrix.md is generated from the matrix the suite runs: it must show every cell."""

from __future__ import annotations

from pathlib import Path

from tests.ranks import fault_matrix as fm

DOC = Path(__file__).resolve().parents[2] / "docs" / "fault-matrix.md"


def test_the_doc_has_every_cell_and_every_cell_passed_when_generated():
    text = DOC.read_text()
    table = [line for line in text.splitlines() if line.startswith("| `")][:len(fm.ROWS)]
    assert [line.split("|")[1].strip().strip("`") for line in table] == [row.stage for row in fm.ROWS]
    header = next(line for line in text.splitlines() if line.startswith("| stage | "))
    assert [c.strip() for c in header.split("|")[2:-1]] == list(fm.FAULTS)
    starred = set()
    for row, line in zip(fm.ROWS, table):
        cells = [c.strip() for c in line.split("|")[2:-1]]
        assert len(cells) == len(fm.FAULTS) and all(c.startswith("pass") for c in cells), line
        starred |= {(row.stage, fault) for fault, c in zip(fm.FAULTS, cells) if c.endswith("*")}
    # The stars and the count say which cells the default run takes, as the tests define them.
    assert starred == set(fm.DEFAULT_CELLS)
    assert f"takes {len(fm.DEFAULT_CELLS)} of the {len(fm.ROWS) * len(fm.FAULTS)} cells" in text


def test_the_default_tier_crosses_every_fault_inside_a_stage_and_at_launch():
    """Every fault once (issue 40 took the default tier from every stage, 11 cells, to 7: the stage
    is a name the watchdog records, the fault's path is the same at every stage); the rank's
    out-of-memory also at launch, where the launcher names it, and a probe, training and the
    report stage among them."""
    assert {fault for _, fault in fm.DEFAULT_CELLS} == set(fm.FAULTS)
    stages = {stage for stage, _ in fm.DEFAULT_CELLS}
    assert {"launch", "train", "report"} <= stages and any(s.startswith("probe:") for s in stages)
    assert stages <= {row.stage for row in fm.ROWS}


def test_a_failed_cell_is_shown_as_failed_with_why():
    result = fm.CellResult("train", "hang", passed=False, exit_code=0, wall_s=3.0, problems=["exit code 0, expected 2"])
    text = fm.render_doc({("train", "hang"): result})
    assert "| `train` | not run | **FAIL** (3 s) *" in text
    assert "FAIL: exit code 0, expected 2" in text and "0 of 1 cells run passed; 65 not run." in text

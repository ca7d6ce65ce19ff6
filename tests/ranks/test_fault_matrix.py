"""The fault matrix, end to end: each stage x each fault is one real `ddpdoctor check`.

The rules every cell keeps are in `fault_matrix.check_cell`; the cells the default run
takes are `fault_matrix.default_cells()` (every stage and every fault), the rest are the slow tier:
fault_matrix.py says, for each fault kind, which default test crosses the left-out cells' path.
Each result is saved, and `--write-fault-matrix` turns them into docs/fault-matrix.md.
"""

from __future__ import annotations

import pytest

from . import fault_matrix as fm
from .harness import assert_nothing_left, run_check

pytestmark = pytest.mark.ranks

_DEFAULT = fm.default_cells()
CELLS = [pytest.param(row, fault, id=f"{row.stage}-{fault}",
                      marks=() if (row.stage, fault) in _DEFAULT else pytest.mark.slow)
         for row in fm.ROWS for fault in fm.FAULTS]


@pytest.mark.parametrize("row, fault", CELLS)
def test_fault_cell(tmp_path, fault_matrix_results, row, fault):
    run = run_check(tmp_path, *fm.argv(row, fault), timeout_s=fm.WALL_LIMIT_S + 30)
    result = fm.check_cell(run, row, fault)
    try:
        assert_nothing_left(run)
    except AssertionError as exc:
        result.problems.append(str(exc).splitlines()[0])
        result.passed = False
    fm.save(result, fault_matrix_results)
    assert result.passed, "; ".join(result.problems) + "\n" + run.explain()

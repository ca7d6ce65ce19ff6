"""`ddpdoctor diagnose` over several files where some cannot be read: each costs one line naming
it and what was expected, the others are still judged (their findings are printed and in the
JSON), and the exit code is 3 (issue 28, point 5). The API's `load_inputs` keeps its contract:
the first unreadable file is a UsageError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpdoctor import cli
from ddpdoctor.core.errors import UsageError
from ddpdoctor.snapshot import load_inputs, read_inputs

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SNAPSHOT = FIXTURES / "homogeneity" / "cpu_vm_2core_recorded.json"
TOPO = FIXTURES / "gpu_outputs" / "topo_a10x4_sys_healthy.txt"


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    cut_topo = tmp_path / "cut-topo.txt"
    lines = TOPO.read_text().splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("GPU1"))
    cut_topo.write_text("\n".join(lines[:row] + [lines[row][:12]]) + "\n")
    other = tmp_path / "notes.txt"
    other.write_text("Reminder: rerun the job on Monday.\nThe cluster is fine.\n")
    binary = tmp_path / "core.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(64))
    xml = tmp_path / "smi.xml"
    xml.write_text("<?xml version=\"1.0\" ?>\n<nvidia_smi_log>\n\t<driver_version>535.54</driver_version>\n\t<gpu id=")
    return {"cut topo -m": cut_topo, "another kind": other, "binary": binary, "truncated XML": xml}


def test_each_unreadable_file_is_one_line_and_the_rest_is_still_judged(tmp_path, capsys):
    bad = _bad_files(tmp_path)
    out = tmp_path / "d.json"
    code = cli.main(["diagnose", str(SNAPSHOT), *map(str, bad.values()), str(TOPO), "--json", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3
    assert len(err) == len(bad), err  # one line per bad file, nothing else on stderr
    for path, line in zip(bad.values(), err):
        assert line.startswith("ddpdoctor: error: ") and str(path) in line, line
    assert "cut short" in err[0] or "cut" in err[0] and "row" in err[0], err[0]
    assert "nor an output ddpdoctor reads" in err[1] and "nvidia-smi -q" in err[1]
    diagnosis = json.loads(out.read_text())
    # The good snapshot (1 CPU rank) and the good topo -m (4 GPUs) were judged.
    assert diagnosis["world_size"] == 5, diagnosis["nodes"]
    assert any(f["code"] == "INP001" for f in diagnosis["findings"])
    assert diagnosis["exit_code"] == 3 and diagnosis["verdict"] == "unknown" and len(diagnosis["unreadable"]) == 4
    assert "is not a text file" in err[2] and "cut short" in err[3], err


def test_the_api_still_refuses_the_first_unreadable_file(tmp_path):
    bad = _bad_files(tmp_path)
    with pytest.raises(UsageError, match="notes.txt"):
        load_inputs([str(SNAPSHOT), str(bad["another kind"])])
    partial = read_inputs([str(SNAPSHOT), str(bad["another kind"])])
    assert partial.world_size == 1 and len(partial.unreadable) == 1


def test_nothing_readable_is_the_one_line_of_the_first_file(tmp_path, capsys):
    bad = _bad_files(tmp_path)
    assert cli.main(["diagnose", str(bad["another kind"]), str(bad["binary"])]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "notes.txt" in err[0], err


def test_a_folder_per_node_names_its_node(tmp_path, capsys):
    node = tmp_path / "gpu-node-07"
    node.mkdir()
    (node / "topo.txt").write_text(TOPO.read_text())
    out = tmp_path / "d.json"
    assert cli.main(["diagnose", str(node), "--json", str(out)]) in (0, 1, 2)
    assert json.loads(out.read_text())["nodes"] == ["gpu-node-07"]

"""The probes/ folder must install as ddpdoctor.probes, never as a bare top-level `probes`."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_probes_inside_the_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, capture_output=True, timeout=120)
    wheel = next(tmp_path.glob("ddpdoctor-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "ddpdoctor/probes/ddp_smoke.py" in names
    assert not [n for n in names if n.startswith("probes/")]
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["ddpdoctor"]

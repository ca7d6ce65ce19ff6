"""`dcgmi diag -r N` output, the table and the `-j` JSON, read into the homogeneity facts: per
GPU, each DCGM test's result (Pass, Fail, Warn, Skip) and DCGM's own warning and info text.

The table wraps DCGM's text at a fixed width, mid-word; a chunk as wide as the column was cut
there, a narrower one lost its trailing space to the padding, so chunks are joined without or
with a space accordingly. A result names its GPUs ("Fail - GPU: 0", "Pass - GPUs: 1, 2", "Pass -
All"; DCGM 4: "GPU0: Pass" lines); a deployment test's bare "Pass" holds for every GPU. A
warning that starts with "GPU n" is that GPU's; DCGM's tests are read, never judged, here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ddpdoctor.core.errors import UsageError
from ddpdoctor.ingest.model import ToolOutput
from ddpdoctor.probes.homogeneity.facts import (
    DiagnosticFacts, DiagTestFacts, GpuFacts, HomogeneityFacts, SoftwareFacts)

KIND = "dcgmi-diag"
PROBE = "homogeneity"
ALL = -1  # a result or message for every GPU of the run

CANNOT_SHOW = ["GPU names, bus ids and NVML's health readings (read nvidia-smi -q beside it)",
               "torch, NCCL, Python and OS versions", "host CPU and RAM", "measured matmul speed"]

_SECTION = re.compile(r"^[|+]-{2,}\s+(\w[\w /]*?)\s+-+[+|]")
_RESULT = re.compile(r"^(Pass|Fail|Skip|Warn)(?:\s*-\s*(All|GPUs?:\s*([\d,\s]+)))?\s*$", re.I)
_GPU_RESULT = re.compile(r"^GPU\s*(\d+)\s*:\s*(Pass|Fail|Skip|Warn)\s*$", re.I)
_MESSAGE = re.compile(r"^(Warning|Info)(?::\s*GPU\s*(\d+))?$", re.I)
_NAMES_GPU = re.compile(r"^GPU\s*(\d+)\b")
_LEVEL = re.compile(r"dcgmi\s+diag\b.*?(?:-r|--run)\s*(\d)")
_METADATA = {"dcgm version": "dcgm_version", "driver version detected": "driver",
             "gpu device ids detected": "device_ids"}


@dataclass
class _Test:
    name: str
    category: Optional[str]
    results: dict[int, str] = field(default_factory=dict)  # GPU (or ALL) -> result
    warnings: list[tuple[int, str]] = field(default_factory=list)  # (GPU or ALL, text)
    info: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class _Run:
    tests: list[_Test] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)


def _gpu_of(text: str) -> int:
    m = _NAMES_GPU.match(text)
    return int(m[1]) if m else ALL


def _ids(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


# -- the table -----------------------------------------------------------------------------------

def _cells(line: str) -> Optional[tuple[str, str]]:
    """(first column, second column as printed, less the one space after the bar)."""
    parts = line.strip().split("|")
    if len(parts) < 3 or not line.strip().startswith("|"):
        return None
    second = parts[2]
    return parts[1].strip(), (second[1:] if second.startswith(" ") else second).rstrip()


def _join(chunks: list[str]) -> str:
    """DCGM's wrapped text back into one line (see the module's docstring)."""
    width = max(len(c) for c in chunks)
    text = chunks[0]
    for before, chunk in zip(chunks, chunks[1:]):
        text += chunk if len(before) == width else " " + chunk
    return text.strip()


def _result_line(test: _Test, text: str) -> bool:
    """A result cell ("Fail - GPU: 0", "Pass - All", "GPU3: Pass") added to the test; False if it is none."""
    m = _RESULT.match(text)
    if m:
        for gpu in (_ids(m[3]) if m[3] else [ALL]):
            test.results[gpu] = m[1].capitalize()
        return True
    m = _GPU_RESULT.match(text)
    if m:
        test.results[int(m[1])] = m[2].capitalize()
        return True
    return False


def _read_table(path: str, text: str) -> _Run:
    run = _Run()
    category: Optional[str] = None
    message: Optional[tuple[_Test, str, int, list[str]]] = None  # (test, kind, gpu, chunks) being read

    def close() -> None:
        nonlocal message
        if message is not None:
            test, kind, gpu, chunks = message
            said = _join(chunks)
            getattr(test, kind).append((gpu if gpu != ALL else _gpu_of(said), said))
            message = None

    for line in text.splitlines():
        section = _SECTION.match(line.strip())
        if section:
            close()
            category = section[1].strip()
            continue
        cells = _cells(line)
        if cells is None:
            continue
        first, second = cells
        if (first.lower(), second.strip().lower()) == ("diagnostic", "result") or (not first and not second):
            continue
        if category is not None and category.lower() == "metadata" and first:
            run.metadata[_METADATA.get(first.lower(), first)] = second.strip()
            continue
        kind = _MESSAGE.match(first)
        if kind:
            close()
            if not run.tests:
                raise UsageError(f"{path}: a dcgmi diag {kind[1]} row comes before any test: was the table cut?")
            message = (run.tests[-1], "warnings" if kind[1].lower() == "warning" else "info",
                       int(kind[2]) if kind[2] else ALL, [second])
        elif not first and message is not None:
            message[3].append(second)
        elif not first:
            if run.tests and not _result_line(run.tests[-1], second.strip()):
                raise UsageError(f"{path}: dcgmi diag row {second.strip()!r} is neither a result nor a message")
        else:
            close()
            test = _Test(first, category)
            run.tests.append(test)
            _result_line(test, second.strip())
    close()
    return run


# -- the JSON (-j) -------------------------------------------------------------------------------

def _texts(value: Any) -> list[str]:
    """DCGM's warnings/info: a string, a list of strings, or of {"warning"|"message": text, ...}."""
    items = value if isinstance(value, list) else [value] if value else []
    out = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("warning") or item.get("message") or item.get("info") or ""
        if isinstance(item, str) and item.strip():
            out.append(item.strip())
    return out


def _result_gpus(result: dict[str, Any]) -> list[int]:
    if "entity_id" in result and str(result.get("entity_group", "GPU")).upper() == "GPU":
        return [int(result["entity_id"])]
    ids = result.get("gpu_ids", result.get("gpu_id"))
    return _ids(str(ids)) if ids is not None and str(ids).strip() else [ALL]


def _read_json(path: str, text: str) -> _Run:
    try:
        doc = json.loads(text[text.index("{"):])
    except (ValueError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: dcgmi diag -j output is not whole JSON ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0][:80]}): was it cut short?") from None
    root = doc.get("DCGM GPU Diagnostic") or doc.get("DCGM Diagnostic") if isinstance(doc, dict) else None
    if not isinstance(root, dict) or not isinstance(root.get("test_categories"), list):
        raise UsageError(f"{path}: JSON without DCGM's \"test_categories\": expected the output of dcgmi diag -j")
    run = _Run(metadata={k: str(root[j]) for k, j in (("dcgm_version", "version"), ("driver", "Driver Version Detected"))
                         if j in root})
    devices = root.get("GPU Device IDs")
    if isinstance(devices, list):
        run.metadata["device_ids"] = ",".join(str(d) for d in devices)
    for category in root["test_categories"]:
        for entry in category.get("tests") or []:
            test = _Test(str(entry.get("name", "?")), category.get("category"))
            for result in entry.get("results") or []:
                if not isinstance(result, dict):
                    continue
                gpus = _result_gpus(result)
                for gpu in gpus:
                    test.results[gpu] = str(result.get("status", "?")).capitalize()
                    test.warnings += [(gpu, t) for t in _texts(result.get("warnings"))]
                    test.info += [(gpu, t) for t in _texts(result.get("info"))]
            run.tests.append(test)
    return run


# -- facts ---------------------------------------------------------------------------------------

def _every_gpu(run: _Run) -> list[int]:
    """The GPUs of the run: as many as DCGM detected, and every one a result or message names."""
    named = {g for t in run.tests for g in [*t.results, *(g for g, _ in t.warnings + t.info)] if g != ALL}
    detected = [d for d in run.metadata.get("device_ids", "").split(",") if d.strip()]
    return sorted(named | set(range(len(detected)))) or [0]


def _test_for(test: _Test, gpu: int) -> Optional[DiagTestFacts]:
    """The test as it concerns one GPU, or None where DCGM's result names other GPUs only."""
    result = test.results.get(gpu, test.results.get(ALL))
    if result is None:
        return None
    mine = lambda said: [t for g, t in said if g in (gpu, ALL)]  # noqa: E731
    return DiagTestFacts(name=test.name, category=test.category, result=result, warnings=mine(test.warnings),
                         info=mine(test.info))


def _level(text: str) -> Optional[int]:
    m = _LEVEL.search(text)
    return int(m[1]) if m else None


def _output(path: str, run: _Run, level: Optional[int]) -> ToolOutput:
    if not run.tests:
        raise UsageError(f"{path} looks like dcgmi diag output but holds no test result: was it cut short?")
    out = ToolOutput(path=path, kind=KIND, cannot_show=list(CANNOT_SHOW))
    for gpu in _every_gpu(run):
        tests = [t for t in (_test_for(test, gpu) for test in run.tests) if t is not None]
        diagnostic = DiagnosticFacts(level=level, dcgm_version=run.metadata.get("dcgm_version"), tests=tests)
        out.gpus[gpu] = {PROBE: HomogeneityFacts(software=SoftwareFacts(driver=run.metadata.get("driver")),
                                                 gpu=GpuFacts(nvml_index=gpu, diagnostic=diagnostic), source=KIND)}
    return out


def _is_json(text: str) -> bool:
    return bool(re.search(r"^\s*\{", text, re.M)) and "test_categories" in text


def read(path: str, text: str) -> ToolOutput:
    run = _read_json(path, text) if _is_json(text) else _read_table(path, text)
    return _output(path, run, _level(text))

"""Snapshots: one node's facts in a file, and diagnosis from such files.

A support engineer cannot log in to a user's cluster; a user can run `ddpdoctor
snapshot` on each node and attach the files. Each file holds what the probes read
without peers, one entry per GPU as one rank per GPU would read it (homogeneity only:
gpu-count's facts are what one rank's launch environment makes it see), so the same
diagnose functions judge files and live runs alike. `ddpdoctor diagnose` also takes
JSON reports of earlier `check` runs, to re-judge them (say with another threshold).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ddpdoctor import __version__
from ddpdoctor.errors import UsageError
from ddpdoctor.findings import Finding, Severity, exit_code_for

SCHEMA = "ddpdoctor.snapshot/1"
REPORT_SCHEMA = "ddpdoctor.report/1"
DIAGNOSIS_SCHEMA = "ddpdoctor.diagnosis/1"


def _devices() -> list[Any]:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def take_snapshot(measure: bool = True) -> dict[str, Any]:
    """This node's facts, one entry per device, as ranks 0..n-1 of this node would read them."""
    from ddpdoctor.node_facts import read_device_facts, read_gpu_state
    from ddpdoctor.throughput import measure_matmul

    host = socket.gethostname()
    devices = _devices()
    entries = []
    for local_rank, device in enumerate(devices):
        facts = read_device_facts(device)
        facts.update(host=host, rank=local_rank, local_rank=local_rank, local_world_size=len(devices),
                     world_size=len(devices), source="snapshot")
        if measure:
            facts["measured"] = {"matmul": measure_matmul(device).to_json()}
            if facts.get("gpu"):
                facts["gpu"].update(read_gpu_state(facts["gpu"].get("uuid")))
        entries.append(facts)
    return {"schema": SCHEMA, "ddpdoctor_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": host, "measured": measure,
            "probes": {"homogeneity": entries, "topology": _topology_entries(host, devices, measure)}}


def _topology_entries(host: str, devices: list[Any], measure: bool) -> list[dict[str, Any]]:
    """The topology probe's facts as ranks 0..n-1 of this node read them; no CPU placement,
    since this process is not a rank (its affinity says nothing about how a job binds ranks)."""
    from ddpdoctor.host_layout import numa_nodes
    from ddpdoctor.probes.topology import read_node, read_rank
    from ddpdoctor.topology_reading import read_link_under_load

    numa = numa_nodes()
    entries = []
    for local_rank, device in enumerate(devices):
        facts = read_rank(device, local_rank, host, local_rank, numa)
        facts["placement"] = {"unknown": "a snapshot is not a rank: CPU binding is the job's"}
        if local_rank == 0:
            facts["node"] = read_node(numa, "127.0.0.1", 0, host)
        if measure:
            facts["load"] = read_link_under_load(device, facts["gpu_uuid"])
        entries.append(facts)
    return entries


@dataclass
class Inputs:
    """Facts from several files, renumbered into one job's ranks, file by file."""

    facts: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return max(self.hosts, default=-1) + 1


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a folder: give snapshot or report files") from None
    except PermissionError:
        raise UsageError(f"{path}: permission denied") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file: give a snapshot (ddpdoctor snapshot --out FILE) "
                         "or a report (ddpdoctor check --json FILE)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg}): was it cut short?") from None
    if not isinstance(data, dict) or data.get("schema") not in (SCHEMA, REPORT_SCHEMA):
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"{path} is not a ddpdoctor snapshot or report (schema {found!r}; expected "
                         f"{SCHEMA} or {REPORT_SCHEMA})")
    return data


def _per_rank(path: str, data: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A file's facts as probe → list of rank facts, in the file's rank order."""
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        if data["schema"] == SCHEMA:
            for name, entries in data["probes"].items():
                out[name] = [dict(e) for e in entries]
        else:
            for probe in data["probes"]:
                ranked = sorted(probe.get("facts", {}).items(), key=lambda kv: int(kv[0]))
                out[probe["name"]] = [dict(v, rank=int(k)) for k, v in ranked]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{path} has the right schema but a malformed body ({type(exc).__name__}: {exc}): "
                         "regenerate it with this ddpdoctor version") from None
    return out


def _hosts_of(data: Mapping[str, Any]) -> dict[int, str]:
    """A report's own rank table says each rank's host; probe facts may not (ddp-smoke's do not)."""
    if data.get("schema") != REPORT_SCHEMA:
        return {}
    return {int(r["rank"]): str(r["host"]) for r in data.get("ranks") or []
            if isinstance(r, Mapping) and "rank" in r and r.get("host") not in (None, "?")}


def load_inputs(paths: list[str]) -> Inputs:
    from ddpdoctor.probes import all_probes

    known = all_probes()
    inputs = Inputs(files=list(paths))
    owner: dict[str, int] = {}  # host name -> the file (by position) that first had it
    labels: set[str] = set()
    for index, path in enumerate(paths):
        data = _read(path)
        per_probe = _per_rank(path, data)
        base = max(inputs.hosts, default=-1) + 1  # past every rank so far, even with gaps
        hosts = _hosts_of(data)
        renamed: dict[str, str] = {}

        def label(host: str) -> str:
            if owner.setdefault(host, index) == index:
                return host
            if host not in renamed:  # the same machine in two files, or one file given twice
                name = f"{host} ({os.path.basename(path)})"
                renamed[host] = name if name not in labels else f"{host} ({os.path.basename(path)} #{index + 1})"
                labels.add(renamed[host])
            return renamed[host]

        local_ranks: set[int] = set()
        for name, entries in per_probe.items():
            if name not in known:
                continue  # written by a newer ddpdoctor: judge what this one knows
            for offset, entry in enumerate(entries):
                own = int(entry.get("rank", offset)) if data["schema"] == REPORT_SCHEMA else offset
                rank = base + own
                host = label(hosts.get(own) or str(entry.get("host") or "?"))
                inputs.facts.setdefault(name, {})[rank] = dict(entry, rank=rank, host=host)
                inputs.hosts[rank] = host
                local_ranks.add(rank)
        if not local_ranks:
            raise UsageError(f"{path} holds no facts this ddpdoctor can judge (probes: "
                             f"{', '.join(per_probe) or 'none'})")
        if isinstance(data.get("settings"), Mapping):
            for key, value in data["settings"].items():
                inputs.settings.setdefault(key, value)  # the thresholds the report was judged with
    return inputs


@dataclass
class Diagnosis:
    inputs: Inputs
    findings: list[Finding]

    @property
    def exit_code(self) -> int:
        return exit_code_for(f.severity for f in self.findings)

    def nodes(self) -> list[str]:
        return list(dict.fromkeys(self.inputs.hosts[r] for r in sorted(self.inputs.hosts)))

    def to_json(self) -> dict[str, Any]:
        from ddpdoctor.report import VERDICTS

        return {"schema": DIAGNOSIS_SCHEMA, "ddpdoctor_version": __version__, "inputs": self.inputs.files,
                "world_size": self.inputs.world_size, "nodes": self.nodes(), "settings": self.inputs.settings,
                "verdict": VERDICTS[self.exit_code],
                "worst_severity": max((f.severity for f in self.findings), default=Severity.OK).label,
                "exit_code": self.exit_code, "findings": [f.to_json() for f in self.findings]}


def diagnose_inputs(inputs: Inputs) -> Diagnosis:
    from ddpdoctor.probes import RunView, get_probe
    from ddpdoctor.probes.base import diagnose_safely

    view = RunView(world_size=inputs.world_size, hosts=inputs.hosts, settings=inputs.settings)
    findings: list[Finding] = []
    for name, facts in inputs.facts.items():
        findings += diagnose_safely(get_probe(name), facts, view)
    return Diagnosis(inputs, findings)


def write_snapshot(snapshot: Mapping[str, Any], path: Optional[str]) -> str:
    from ddpdoctor.report import atomic_write_json

    target = path or f"ddpdoctor-snapshot-{snapshot['host']}.json"
    atomic_write_json(snapshot, target)
    return target

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
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ddpdoctor import __version__
from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.exits import EXIT_UNKNOWN
from ddpdoctor.core.findings import Finding, Severity, exit_code_for

if TYPE_CHECKING:  # the type only: ingest is imported when a file needs it
    from ddpdoctor.ingest.model import ToolOutput

# A snapshot is a few KiB per device and a report of 1000 ranks a few MiB: a file past this
# is not one of ours, and json would hold ~10x its size in memory.
MAX_INPUT_BYTES = 64 << 20

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
    from ddpdoctor.measure.node import read_device_facts, read_gpu_state
    from ddpdoctor.measure.throughput import measure_matmul

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
            "probes": {"homogeneity": entries, "topology": _topology_entries(host, devices, measure),
                       "limits": _limits_entries(host, devices)}}


def _limits_entries(host: str, devices: list[Any]) -> list[dict[str, Any]]:
    """The limits probe's facts as ranks 0..n-1 of this node would read them: this process runs in
    the same container, cgroup and rlimits a job started here would (a few reads, no measurement)."""
    from ddpdoctor.measure.limits import read_limits

    gpus = sum(1 for d in devices if d.type == "cuda")
    entries = []
    for local_rank in range(len(devices)):
        facts = read_limits(None)
        facts.host, facts.rank, facts.local_rank = host, local_rank, local_rank
        facts.local_world_size, facts.world_size, facts.gpus = len(devices), len(devices), gpus
        entries.append(facts.to_json())
    return entries


def _topology_entries(host: str, devices: list[Any], measure: bool) -> list[dict[str, Any]]:
    """The topology probe's facts as ranks 0..n-1 of this node read them; no CPU placement,
    since this process is not a rank (its affinity says nothing about how a job binds ranks)."""
    from ddpdoctor.measure.host_layout import numa_nodes
    from ddpdoctor.probes.topology.probe import read_node, read_rank
    from ddpdoctor.measure.topology import read_link_under_load

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
    # Other tools' outputs that were read (ingest/): path, kind, node, what they cannot show.
    ingested: list[dict[str, Any]] = field(default_factory=list)
    # One line per tool output that could not be read: the others are still judged, then exit 3.
    unreadable: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return max(self.hosts, default=-1) + 1


def _read(path: str) -> dict[str, Any]:
    """A snapshot or report file, or a one-line UsageError: never a hang (a FIFO), never a
    file read whole into memory before its size is known, and never anything but JSON
    (a pickle is refused by its first bytes; nothing here can unpickle)."""
    return _checked(path, _parse(path, _read_bytes(path)))


def _checked(path: str, data: Any) -> dict[str, Any]:
    """`data` if it is a snapshot or a report, else the one line saying what it is instead."""
    if not isinstance(data, dict) or data.get("schema") not in (SCHEMA, REPORT_SCHEMA):
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"{path} is not a ddpdoctor snapshot or report (schema {found!r}; expected "
                         f"{SCHEMA} or {REPORT_SCHEMA})")
    return data


def _read_bytes(path: str) -> bytes:
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a folder: give snapshot or report files") from None
    except PermissionError:
        raise UsageError(f"{path}: permission denied") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot open it ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"{path} is a folder: give snapshot or report files")
        if not stat.S_ISREG(mode):
            raise UsageError(f"{path} is not a regular file (a FIFO, device or socket): give snapshot or report files")
        size = os.fstat(fd).st_size
        if size > MAX_INPUT_BYTES:
            raise UsageError(_too_big(path, size))
        chunks, total = [], 0
        while True:  # st_size can lie (/proc) or grow: read at most one byte past the limit
            piece = os.read(fd, min(1 << 20, MAX_INPUT_BYTES + 1 - total))
            if not piece:
                break
            chunks.append(piece)
            total += len(piece)
            if total > MAX_INPUT_BYTES:
                raise UsageError(_too_big(path, total))
        return b"".join(chunks)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def _too_big(path: str, size: int) -> str:
    return (f"{path} is {size / 2**20:.0f} MiB, over the {MAX_INPUT_BYTES >> 20} MiB limit for snapshot and "
            "report files: is it the right file?")


def _parse(path: str, raw: bytes) -> Any:
    hint = ("give a snapshot (ddpdoctor snapshot --out FILE) or a report (ddpdoctor check --json FILE)")
    if raw[:1] == b"\x80" and raw[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise UsageError(f"{path} looks like a pickle: diagnose reads JSON only and never unpickles; {hint}")
    if b"\x00" in raw[:8192]:  # no text output of any tool ddpdoctor reads holds a NUL byte
        raise UsageError(f"{path} is not a text file (it holds NUL bytes): {hint}, or a tool output")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file: {hint}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg}): was it cut short?") from None
    except RecursionError:
        raise UsageError(f"{path} nests JSON deeper than Python can read: not a ddpdoctor file; {hint}") from None


def _per_rank(path: str, data: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A file's facts as probe → list of rank facts, in the file's rank order."""
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        if data["schema"] == SCHEMA:
            for name, entries in data["probes"].items():
                out[str(name)] = [_entry(e) for e in entries]
        else:
            for probe in data["probes"]:
                ranked = sorted(probe.get("facts", {}).items(), key=lambda kv: int(kv[0]))
                out[_name(probe["name"])] = [dict(_entry(v), rank=int(k)) for k, v in ranked]
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise UsageError(f"{path} has the right schema but a malformed body ({_brief(exc)}): "
                         "regenerate it with this ddpdoctor version") from None
    return out


def _entry(value: Any) -> dict[str, Any]:
    """One rank's facts: an object whose host, if any, is a name (dict() would also take a
    list of pairs, and str() would turn any value into a host)."""
    if not isinstance(value, Mapping):
        raise TypeError(f"rank facts are {type(value).__name__}, not an object")
    if not isinstance(value.get("host", ""), (str, type(None))):
        raise TypeError(f"host is {type(value['host']).__name__}, not a name")
    return dict(value)


def _brief(exc: BaseException) -> str:
    """An exception in an error line: a hostile file can make its text arbitrarily long."""
    text = str(exc)
    return f"{type(exc).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def _name(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"probe name is {type(value).__name__}, not a string")
    return value


def _hosts_of(path: str, data: Mapping[str, Any]) -> dict[int, str]:
    """A report's own rank table says each rank's host; probe facts may not (ddp-smoke's do not)."""
    if data.get("schema") != REPORT_SCHEMA:
        return {}
    ranks = data.get("ranks") or []
    try:
        return {int(r["rank"]): str(r["host"]) for r in ranks
                if isinstance(r, Mapping) and "rank" in r and isinstance(r.get("host"), str) and r["host"] != "?"}
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"{path} has the right schema but a malformed rank table ({_brief(exc)}): "
                         "regenerate it with this ddpdoctor version") from None


def _expand(paths: list[str]) -> list[tuple[str, Optional[str]]]:
    """Each file with the node its folder names: `diagnose node07/ node08/` reads every file of
    each folder as that node's (a folder per node); files given directly name no node."""
    out: list[tuple[str, Optional[str]]] = []
    for path in paths:
        if os.path.isdir(path):
            names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
            if not names:
                raise UsageError(f"{path} is a folder with no files: give snapshot, report or tool-output files")
            host = os.path.basename(os.path.normpath(path))
            out += [(os.path.join(path, n), host) for n in names]
        else:
            out.append((path, None))
    return out


def _tool_output(path: str, raw: bytes, folder_host: Optional[str]) -> Optional[ToolOutput]:
    """The file read as another tool's output when its content says which tool; None for JSON,
    binary or empty files, which the snapshot/report reading judges as before tool outputs were
    read; one line for text that is neither."""
    from ddpdoctor.ingest.detect import detect
    from ddpdoctor.ingest.load import EXPECTED, read_tool_output
    from ddpdoctor.ingest.paste import starts_with_prompt

    head = raw[:1 << 20]
    # A paste may start with a bracket or a parenthesis: `[root@node2 ~]# ...`, `(venv) $ ...`.
    pasted = starts_with_prompt(head[:4096].decode("utf-8", errors="replace"))
    if not head.strip() or (head.lstrip()[:1] in (b"{", b"[") and not pasted) or b"\x00" in raw[:8192]:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return None  # "is not a text file", from the JSON reading
    kind = detect(text)
    if kind is None:
        if not pasted and (text.lstrip()[:1] == "(" or _is_json(text)):  # a protocol-0 pickle, or a JSON
            return None                                   # scalar: the JSON reading says what it is instead
        raise UsageError(f"{path} is not valid JSON nor an output ddpdoctor reads: expected {EXPECTED}")
    return read_tool_output(path, raw, folder_host, kind)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def load_inputs(paths: list[str]) -> Inputs:
    """Every file read, or the first that cannot be, as one UsageError: the API's contract."""
    inputs = read_inputs(paths)
    if inputs.unreadable:
        raise UsageError(inputs.unreadable[0])
    return inputs


def read_inputs(paths: list[str]) -> Inputs:
    """Every file that can be read; one line in `unreadable` for each that cannot (the CLI judges
    the rest, then exits 3). Raises only when nothing at all could be read."""
    from ddpdoctor.probes import all_probes

    known = all_probes()
    files = _expand(paths)
    inputs = Inputs(files=[p for p, _ in files])
    owner: dict[str, int] = {}  # host name -> the file (by position) that first had it
    labels: set[str] = set()
    outputs: list[ToolOutput] = []
    for index, (path, folder_host) in enumerate(files):
        try:
            raw = _read_bytes(path)
            tool = _tool_output(path, raw, folder_host)
            if tool is not None:
                outputs.append(tool)
            else:
                _add_file(inputs, known, index, path, _checked(path, _parse(path, raw)), owner, labels)
        except UsageError as exc:  # one line for this file; the others are still judged
            inputs.unreadable.append(str(exc))
    _add_nodes(inputs, outputs, owner)
    if not inputs.hosts:
        raise UsageError(inputs.unreadable[0] if inputs.unreadable else "no input to diagnose")
    return inputs


def _add_file(inputs: Inputs, known: Mapping[str, Any], index: int, path: str, data: dict[str, Any],
              owner: dict[str, int], labels: set[str]) -> None:
    """A snapshot's or report's ranks, numbered after every rank so far; a host another file
    already named is told apart by this file's name."""
    per_probe = _per_rank(path, data)
    base = max(inputs.hosts, default=-1) + 1  # past every rank so far, even with gaps
    hosts = _hosts_of(path, data)
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
    entries_by_rank: dict[str, dict[int, dict[str, Any]]] = {}
    for name, entries in per_probe.items():
        if name not in known:
            continue  # written by a newer ddpdoctor: judge what this one knows
        for offset, entry in enumerate(entries):
            own = int(entry["rank"]) if data["schema"] == REPORT_SCHEMA else offset
            rank = base + own
            host = label(hosts.get(own) or str(entry.get("host") or "?"))
            entries_by_rank.setdefault(name, {})[rank] = dict(entry, rank=rank, host=host)
            local_ranks.add(rank)
    if not local_ranks:
        raise UsageError(f"{path} holds no facts this ddpdoctor can judge (probes: "
                         f"{', '.join(per_probe) or 'none'})")
    for name, by_rank in entries_by_rank.items():
        inputs.facts.setdefault(name, {}).update(by_rank)
        inputs.hosts.update({rank: entry["host"] for rank, entry in by_rank.items()})
    if isinstance(data.get("settings"), Mapping):
        for key, value in data["settings"].items():
            inputs.settings.setdefault(key, value)  # the thresholds the report was judged with


def _add_nodes(inputs: Inputs, outputs: list[ToolOutput], owner: dict[str, int]) -> None:
    """Tool outputs, grouped by node: one rank per GPU (by nvidia-smi's index), after every
    snapshot's and report's ranks; a node name a snapshot already used gets the tool's name."""
    from ddpdoctor.ingest.load import group_by_node

    for node in group_by_node(outputs):
        host = node.host if node.host not in owner else f"{node.host} ({node.outputs[0].kind})"
        owner.setdefault(host, -1)
        base = max(inputs.hosts, default=-1) + 1
        for offset, index in enumerate(sorted(node.gpus)):
            rank = base + offset
            inputs.hosts[rank] = host
            for probe, facts in node.gpus[index].items():
                entry = facts.to_json()
                inputs.facts.setdefault(probe, {})[rank] = dict(entry, rank=rank, host=host)
        for out in node.outputs:
            inputs.ingested.append({"path": out.path, "kind": out.kind, "node": host,
                                    "cannot_show": list(out.cannot_show)})


@dataclass
class Diagnosis:
    inputs: Inputs
    findings: list[Finding]

    @property
    def exit_code(self) -> int:
        """The findings' verdict, or 3 (unknown) when a file could not be read: what it held was
        not judged, so no verdict covers it (the job script must look)."""
        if self.inputs.unreadable:
            return EXIT_UNKNOWN
        return exit_code_for(f.severity for f in self.findings)

    def nodes(self) -> list[str]:
        return list(dict.fromkeys(self.inputs.hosts[r] for r in sorted(self.inputs.hosts)))

    def to_json(self) -> dict[str, Any]:
        from ddpdoctor.core.report import VERDICTS

        return {"schema": DIAGNOSIS_SCHEMA, "ddpdoctor_version": __version__, "inputs": self.inputs.files,
                "world_size": self.inputs.world_size, "nodes": self.nodes(), "settings": self.inputs.settings,
                "verdict": VERDICTS[self.exit_code],
                "worst_severity": max((f.severity for f in self.findings), default=Severity.OK).label,
                "exit_code": self.exit_code, "findings": [f.to_json() for f in self.findings],
                "unreadable": list(self.inputs.unreadable)}


def diagnose_inputs(inputs: Inputs) -> Diagnosis:
    """The probes' findings on the files' facts. Unlike a live run (where RUN011 keeps the
    other probes' findings), facts a probe cannot judge here came from a file the user can
    regenerate, so they are a usage error naming the files, not a "report this bug"."""
    from ddpdoctor.probes import RunView, get_probe, with_context

    view = with_context(RunView(world_size=inputs.world_size, hosts=inputs.hosts, settings=inputs.settings),
                        inputs.facts)
    findings: list[Finding] = _ingested_findings(inputs)
    for name, facts in inputs.facts.items():
        try:
            findings += get_probe(name).diagnose(facts, view)
        except Exception as exc:
            if isinstance(exc, UsageError):
                raise
            raise UsageError(f"the {name} facts in {', '.join(inputs.files)} are not what this ddpdoctor "
                             f"({__version__}) can judge ({_brief(exc)}): regenerate the files "
                             "with it, or report a bug if they are its own unchanged output") from None
    return Diagnosis(inputs, findings)


def _ingested_findings(inputs: Inputs) -> list[Finding]:
    """INP001: which files were read as which tool's output, and what those outputs cannot show
    (judged as unknown: a check on the node itself would measure it)."""
    from ddpdoctor.core import codes

    if not inputs.ingested:
        return []
    read = "; ".join(f"{os.path.basename(i['path'])} as {i['kind']} ({i['node']})" for i in inputs.ingested)
    unknown = sorted({what for i in inputs.ingested for what in i["cannot_show"]})
    nodes = tuple(dict.fromkeys(i["node"] for i in inputs.ingested))
    return [codes.finding("INP001", "ingest", f"Read {len(inputs.ingested)} tool output(s): {read}",
                          nodes=nodes, evidence={"files": inputs.ingested, "not_known_from_these_inputs": unknown})]


def default_snapshot_path() -> str:
    return f"ddpdoctor-snapshot-{socket.gethostname()}.json"


def write_snapshot(snapshot: Mapping[str, Any], path: Optional[str], *, overwrite: bool = False) -> str:
    """Returns where it went: `path`, or a sibling name when `path` appeared meanwhile."""
    from ddpdoctor.core.files import atomic_write_json

    target = path or f"ddpdoctor-snapshot-{snapshot['host']}.json"
    try:
        return atomic_write_json(snapshot, target, overwrite=overwrite)
    except OSError as exc:  # the folder went away or filled up while the snapshot was measured
        raise UsageError(f"{target}: cannot write the snapshot ({exc.strerror or exc}): "
                         "give --out a path in a writable folder") from None

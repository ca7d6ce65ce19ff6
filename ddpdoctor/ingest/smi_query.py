"""`nvidia-smi -q` (text) and `nvidia-smi -q -x` (XML) read into the homogeneity probe's facts,
one HomogeneityFacts per GPU, so its diagnosis (memory errors, throttling, power caps, MIG mode,
a PCIe link below its maximum, GPUs that differ) runs on a node ddpdoctor never ran on.

Both formats go through one mapping: each format is first read into the same tree shape (a
section is a dict, a value a string) and `FIELDS` says where each reading sits in either, by every
name a driver generation gave it ("Clocks Throttle Reasons" became "Clocks Event Reasons",
"Power Readings" became "GPU Power Readings" with "Current"/"Requested" limits, ECC counters went
from Single/Double Bit to SRAM/DRAM). `_gpu_facts` then turns one GPU's tree into facts with the
units NVML gives (bytes, watts, MHz), so a snapshot of the same node says the same.

A value nvidia-smi prints as N/A (or "Not Supported") is `{"unknown": ...}`; a reading the output
does not show at all stays None and is listed in `cannot_show`. An excerpt (one section pasted,
no "GPU 0000:..." heading) is one GPU, index 0.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Callable, Optional, TypeVar, Union

from ddpdoctor.core.errors import UsageError
from ddpdoctor.ingest.model import ToolOutput
from ddpdoctor.probes.homogeneity.facts import (ClockEventReasonsFacts, ClocksFacts, EccModeFacts,
                                                EccUncorrectedFacts, GpuFacts, HomogeneityFacts, HostHwFacts,
                                                MigModeFacts, PcieFacts, PowerFacts, RemappedRowsFacts,
                                                RetiredPagesFacts, SoftwareFacts)

TEXT, XML = "nvidia-smi-q", "nvidia-smi-q-xml"
PROBE = "homogeneity"

Tree = dict[str, Union[str, "Tree"]]
Path = tuple[str, ...]
V = TypeVar("V")
Reading = Union[V, dict[str, str], None]  # as in the probe's facts: the value, {"unknown": why}, or not shown

# reading -> (its paths in the text tree, its paths in the XML tree), first found wins. Text keys
# are nvidia-smi's labels lower-cased with single spaces; XML keys are the tag names.
FIELDS: dict[str, tuple[tuple[Path, ...], tuple[Path, ...]]] = {
    "driver": ((("driver version",),), (("driver_version",),)),
    "cuda": ((("cuda version",),), (("cuda_version",),)),
    "attached": ((("attached gpus",),), (("attached_gpus",),)),
    "name": ((("product name",),), (("product_name",),)),
    "uuid": ((("gpu uuid",),), (("uuid",),)),
    "bus_id": ((("pci", "bus id"),), (("pci", "pci_bus_id"),)),
    "memory_total": ((("fb memory usage", "total"),), (("fb_memory_usage", "total"),)),
    "persistence": ((("persistence mode",),), (("persistence_mode",),)),
    "performance_state": ((("performance state",),), (("performance_state",),)),
    "mig_current": ((("mig mode", "current"),), (("mig_mode", "current_mig"),)),
    "mig_pending": ((("mig mode", "pending"),), (("mig_mode", "pending_mig"),)),
    "ecc_current": ((("ecc mode", "current"),), (("ecc_mode", "current_ecc"),)),
    "ecc_pending": ((("ecc mode", "pending"),), (("ecc_mode", "pending_ecc"),)),
    "ecc_volatile": ((("ecc errors", "volatile"),), (("ecc_errors", "volatile"),)),
    "ecc_aggregate": ((("ecc errors", "aggregate"),), (("ecc_errors", "aggregate"),)),
    "retired_single": ((("retired pages", "single bit ecc"),),
                       (("retired_pages", "multiple_single_bit_retirement", "retired_count"),)),
    "retired_double": ((("retired pages", "double bit ecc"),),
                       (("retired_pages", "double_bit_retirement", "retired_count"),)),
    "retired_pending": ((("retired pages", "pending page blacklist"), ("retired pages", "pending")),
                        (("retired_pages", "pending_retirement"), ("retired_pages", "pending_blacklist"))),
    "remapped_rows": ((("remapped rows",),), (("remapped_rows",),)),
    "remap_correctable": ((("remapped rows", "correctable error"),), (("remapped_rows", "remapped_row_corr"),)),
    "remap_uncorrectable": ((("remapped rows", "uncorrectable error"),), (("remapped_rows", "remapped_row_unc"),)),
    "remap_pending": ((("remapped rows", "pending"),), (("remapped_rows", "remapped_row_pending"),)),
    "remap_failed": ((("remapped rows", "remapping failure occurred"),), (("remapped_rows", "remapped_row_failure"),)),
    # nvidia-smi's "Current Power Limit" (R535+) is the enforced one, "Requested" the one set (NVML's limit).
    "power_draw": (tuple((s, k) for s in ("gpu power readings", "power readings")
                         for k in ("power draw", "instantaneous power draw", "average power draw")),
                   tuple((s, k) for s in ("gpu_power_readings", "power_readings")
                         for k in ("power_draw", "instant_power_draw", "average_power_draw"))),
    "power_limit": (tuple((s, k) for s in ("gpu power readings", "power readings")
                          for k in ("power limit", "requested power limit")),
                    tuple((s, k) for s in ("gpu_power_readings", "power_readings")
                          for k in ("power_limit", "requested_power_limit"))),
    "power_enforced": (tuple((s, k) for s in ("gpu power readings", "power readings")
                             for k in ("enforced power limit", "current power limit")),
                       tuple((s, k) for s in ("gpu_power_readings", "power_readings")
                             for k in ("enforced_power_limit", "current_power_limit"))),
    "power_default": ((("gpu power readings", "default power limit"), ("power readings", "default power limit")),
                      (("gpu_power_readings", "default_power_limit"), ("power_readings", "default_power_limit"))),
    "sm_mhz": ((("clocks", "sm"),), (("clocks", "sm_clock"),)),
    "mem_mhz": ((("clocks", "memory"),), (("clocks", "mem_clock"),)),
    "app_sm_mhz": ((("applications clocks", "graphics"),), (("applications_clocks", "graphics_clock"),)),
    "app_mem_mhz": ((("applications clocks", "memory"),), (("applications_clocks", "mem_clock"),)),
    "default_app_sm_mhz": ((("default applications clocks", "graphics"),),
                           (("default_applications_clocks", "graphics_clock"),)),
    "default_app_mem_mhz": ((("default applications clocks", "memory"),),
                            (("default_applications_clocks", "mem_clock"),)),
    "max_sm_mhz": ((("max clocks", "sm"),), (("max_clocks", "sm_clock"),)),
    "max_mem_mhz": ((("max clocks", "memory"),), (("max_clocks", "mem_clock"),)),
    "reasons": ((("clocks event reasons",), ("clocks throttle reasons",)),
                (("clocks_event_reasons",), ("clocks_throttle_reasons",))),
    "temperature": ((("temperature", "gpu current temp"),), (("temperature", "gpu_temp"),)),
    "pcie_gen": ((("pci", "gpu link info", "pcie generation", "current"),),
                 (("pci", "pci_gpu_link_info", "pcie_gen", "current_link_gen"),)),
    "pcie_max_gen": ((("pci", "gpu link info", "pcie generation", "max"),),
                     (("pci", "pci_gpu_link_info", "pcie_gen", "max_link_gen"),)),
    "pcie_width": ((("pci", "gpu link info", "link width", "current"),),
                   (("pci", "pci_gpu_link_info", "link_widths", "current_link_width"),)),
    "pcie_max_width": ((("pci", "gpu link info", "link width", "max"),),
                       (("pci", "pci_gpu_link_info", "link_widths", "max_link_width"),)),
}

# What a reading is called where the output lacks it (INP001 lists these).
GROUPS: dict[str, tuple[str, ...]] = {
    "GPU model and UUID": ("name", "uuid"),
    "ECC mode and error counts": ("ecc_current", "ecc_volatile", "ecc_aggregate"),
    "retired pages": ("retired_single", "retired_pending"),
    "remapped rows": ("remapped_rows",),
    "power limits and draw": ("power_limit", "power_enforced", "power_default", "power_draw"),
    "clocks": ("sm_mhz", "app_sm_mhz", "max_sm_mhz"),
    "clock event (throttle) reasons": ("reasons",),
    "persistence mode": ("persistence",),
    "performance state": ("performance_state",),
    "MIG mode": ("mig_current",),
    "PCIe link": ("pcie_gen", "pcie_width"),
    "temperature": ("temperature",),
    "driver version": ("driver",),
}
# Never in nvidia-smi -q: what the probe reads from torch, the host and a measurement.
NEVER_SHOWN = ("SM count and compute capability", "torch, NCCL, Python and OS versions", "host CPU and RAM",
               "environment variables", "measured matmul speed")

# nvidia-smi's reason names -> the stable names measure.gpu_health writes (NVML's constants).
REASON_NAMES = {"idle": "gpu_idle", "gpu_idle": "gpu_idle", "display_clocks_setting": "display_clock_setting"}
NOT_AVAILABLE = re.compile(r"^\[?(n/a|not supported|not available|unknown error|requested functionality has been "
                           r"deprecated|insufficient permissions|gpu requires reset|unknown)\]?$", re.I)
_GPU_HEADING = re.compile(r"^gpu ([0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f])$", re.I)
_KEY_VALUE = re.compile(r"^(\S.*?)\s*:(?:\s+(.*))?$")
_PROMPT = re.compile(r"^\s*(\S*[@:~]\S*)?[$#]\s")  # a pasted shell prompt: `$ nvidia-smi -q | grep ...`


# -- the two formats, read into one tree shape ---------------------------------------------------

def _text_tree(text: str) -> Tree:
    """Indented `Key : value` lines as nested dicts; a line without a value heads a section of
    the more indented lines below it. The first of two equal keys in a section is kept."""
    root: Tree = {}
    stack: list[tuple[int, Tree]] = [(-1, root)]
    for raw in text.expandtabs(8).splitlines():
        line = raw.rstrip()
        if not line.strip() or set(line.strip()) <= {"=", "-"} or "NVSMI LOG" in line or _PROMPT.match(line):
            continue
        indent = len(line) - len(line.lstrip())
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        match = _KEY_VALUE.match(line.strip())
        if match and match.group(2) is not None:
            parent.setdefault(_label(match.group(1)), match.group(2).strip())
            continue
        section: Tree = {}
        key = _label(match.group(1) if match else line.strip())
        if key not in parent:
            parent[key] = section
        stack.append((indent, section))
    return root


def _label(key: str) -> str:
    return " ".join(key.lower().split())


def _xml_tree(element: ET.Element) -> Union[str, Tree]:
    children = list(element)
    if not children:
        return (element.text or "").strip()
    tree: Tree = {}
    for child in children:
        tree.setdefault(child.tag, _xml_tree(child))
    return tree


def _text_gpus(tree: Tree) -> list[tuple[Optional[str], Tree]]:
    """(bus id from the heading, section) per `GPU 00000000:07:00.0` heading, in nvidia-smi's
    (index) order; an excerpt without one is one GPU."""
    gpus: list[tuple[Optional[str], Tree]] = [(m.group(1), section) for key, section in tree.items()
                                              if isinstance(section, dict) and (m := _GPU_HEADING.match(key))]
    return gpus or [(None, tree)]


# -- one mapping from either tree to the probe's facts ------------------------------------------

class _Reading:
    """Looks FIELDS up in one GPU's tree (then in the log's top, for driver and CUDA versions)."""

    def __init__(self, kind: str, gpu: Tree, top: Tree) -> None:
        self.side = 0 if kind == TEXT else 1
        self.trees = (gpu, top)
        self.found: set[str] = set()

    def raw(self, name: str) -> Union[str, Tree, None]:
        for tree in self.trees:
            for path in FIELDS[name][self.side]:
                node: Union[str, Tree, None] = tree
                for key in path:
                    node = node.get(key) if isinstance(node, dict) else None
                if node is not None:
                    self.found.add(name)
                    return node
        return None

    def value(self, name: str, convert: Callable[[str], V]) -> Reading[V]:
        raw = self.raw(name)
        if raw is None or isinstance(raw, dict):
            return None
        if not raw or NOT_AVAILABLE.match(raw):
            return {"unknown": f"nvidia-smi says {raw or 'nothing'}"}
        try:
            return convert(raw)
        except ValueError:
            return {"unknown": f"nvidia-smi says {raw!r}"}


def _number(text: str) -> float:
    match = re.match(r"^\s*(-?\d+(?:\.\d+)?)", text)
    if match is None:
        raise ValueError(text)
    return float(match.group(1))


def _int(text: str) -> int:
    return int(_number(text))


def _mib_bytes(text: str) -> int:
    return int(_number(text)) * 2**20


def _flag(text: str) -> bool:
    word = text.strip().lower()
    if word in ("enabled", "yes", "active", "on"):
        return True
    if word in ("disabled", "no", "not active", "off"):
        return False
    raise ValueError(text)


def _pstate(text: str) -> str:
    if not re.fullmatch(r"P\d{1,2}", text.strip()):
        raise ValueError(text)
    return text.strip()


def _plain_bool(value: object) -> Optional[bool]:
    return value if isinstance(value, bool) else None


def _uncorrectable(section: Union[str, Tree, None]) -> Reading[int]:
    """Uncorrectable ECC errors in a Volatile/Aggregate section, as NVML totals them: every
    "... Uncorrectable ..." counter (SRAM, DRAM; R550's Parity and SEC-DED), or the Double Bit
    total of older drivers. N/A everywhere is unknown."""
    if not isinstance(section, dict):
        return None if section is None else {"unknown": f"nvidia-smi says {section}"}
    double = section.get("double bit") or section.get("double_bit")
    if isinstance(double, dict):
        section = {"total": double.get("total", "N/A")}
    counts = [v for k, v in section.items() if isinstance(v, str) and ("uncorrectable" in k or k == "total")
              and "threshold" not in k]
    numbers = [int(_number(v)) for v in counts if re.match(r"^\s*\d", v)]
    return sum(numbers) if numbers else {"unknown": "nvidia-smi says N/A"}


def _reasons(section: Union[str, Tree, None]) -> ClockEventReasonsFacts:
    """The Active reasons under their NVML names; nested items (HW Thermal Slowdown under HW
    Slowdown in the text) count as their own. nvidia-smi shows no bit mask: `mask` stays None."""
    if section is None:
        return ClockEventReasonsFacts()
    if not isinstance(section, dict):
        return ClockEventReasonsFacts(unknown=f"nvidia-smi says {section}")
    active: list[str] = []

    def walk(tree: Tree) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value)
                continue
            name = re.sub(r"^clocks_(event|throttle)_reason_", "", key).replace(" ", "_")
            if value.strip().lower() == "active":
                active.append(REASON_NAMES.get(name, name))
    walk(section)
    return ClockEventReasonsFacts(active=active)


def _remapped(r: _Reading) -> RemappedRowsFacts:
    section = r.raw("remapped_rows")
    if isinstance(section, str):
        return RemappedRowsFacts(unknown=f"nvidia-smi says {section}")
    if section is None:
        return RemappedRowsFacts()
    correctable, uncorrectable = r.value("remap_correctable", _int), r.value("remap_uncorrectable", _int)
    return RemappedRowsFacts(correctable=correctable if isinstance(correctable, int) else None,
                             uncorrectable=uncorrectable if isinstance(uncorrectable, int) else None,
                             pending=_plain_bool(r.value("remap_pending", _flag)),
                             failed=_plain_bool(r.value("remap_failed", _flag)))


def _ecc_mode(r: _Reading) -> EccModeFacts:
    current, pending = r.value("ecc_current", _flag), r.value("ecc_pending", _flag)
    if isinstance(current, dict):
        return EccModeFacts(unknown=current["unknown"])
    return EccModeFacts(current=_plain_bool(current), pending=_plain_bool(pending))


def _mig_mode(r: _Reading) -> Optional[MigModeFacts]:
    current, pending = r.value("mig_current", _flag), r.value("mig_pending", _flag)
    if current is None and pending is None:
        return None
    if isinstance(current, dict):
        return MigModeFacts(unknown=current["unknown"])
    return MigModeFacts(current=_plain_bool(current), pending=_plain_bool(pending))


def _bus_id(r: _Reading, heading: Optional[str]) -> Reading[str]:
    """Upper-case, as NVML's busId is recorded; the GPU heading's where the PCI section is absent."""
    bus = r.value("bus_id", str)
    if bus is None and heading is not None:
        bus = heading
    return bus.upper() if isinstance(bus, str) else bus


def _gpu_facts(r: _Reading, index: int, heading: Optional[str]) -> GpuFacts:
    return GpuFacts(
        name=_text(r.value("name", str)), uuid=_text(r.value("uuid", str)),
        memory_total_bytes=r.value("memory_total", _mib_bytes), nvml_index=index, pci_bus_id=_bus_id(r, heading),
        ecc_mode=_ecc_mode(r),
        ecc_uncorrected=EccUncorrectedFacts(volatile=_uncorrectable(r.raw("ecc_volatile")),
                                            aggregate=_uncorrectable(r.raw("ecc_aggregate"))),
        retired_pages=RetiredPagesFacts(pending=r.value("retired_pending", _flag),
                                        single_bit=r.value("retired_single", _int),
                                        double_bit=r.value("retired_double", _int)),
        remapped_rows=_remapped(r),
        power=PowerFacts(limit_w=r.value("power_limit", _number), default_w=r.value("power_default", _number),
                         enforced_w=r.value("power_enforced", _number), draw_w=r.value("power_draw", _number)),
        clocks=ClocksFacts(**{name: r.value(name, _int) for name in (
            "sm_mhz", "mem_mhz", "app_sm_mhz", "app_mem_mhz", "default_app_sm_mhz", "default_app_mem_mhz",
            "max_sm_mhz", "max_mem_mhz")}),
        clock_event_reasons=_reasons(r.raw("reasons")),
        persistence_mode=r.value("persistence", _flag),
        temperature_c=r.value("temperature", _int),
        pcie=PcieFacts(gen=r.value("pcie_gen", _int), max_gen=r.value("pcie_max_gen", _int),
                       width=r.value("pcie_width", _int), max_width=r.value("pcie_max_width", _int)),
        performance_state=r.value("performance_state", _pstate),
        mig_mode=_mig_mode(r),
    )


def _text(value: object) -> Optional[str]:
    return value if isinstance(value, str) else None


def _facts(kind: str, gpu: Tree, top: Tree, index: int, bus_id: Optional[str]) -> tuple[HomogeneityFacts, set[str]]:
    r = _Reading(kind, gpu, top)
    facts = HomogeneityFacts(
        software=SoftwareFacts(driver=r.value("driver", str), cuda_driver=r.value("cuda", str)),
        host_hw=HostHwFacts(node_gpus=r.value("attached", _int)),
        gpu=_gpu_facts(r, index, bus_id), source=kind)
    return facts, r.found


def _output(path: str, kind: str, gpus: list[tuple[Optional[str], Tree]], top: Tree) -> ToolOutput:
    out = ToolOutput(path=path, kind=kind)
    found: set[str] = set()
    for index, (bus_id, tree) in enumerate(gpus):
        facts, seen = _facts(kind, tree, top, index, bus_id)
        found |= seen
        if seen - {"driver", "cuda", "attached"}:
            out.gpus[index] = {PROBE: facts}
    out.cannot_show = [group for group, names in GROUPS.items() if not found & set(names)] + list(NEVER_SHOWN)
    return out


# -- the readers ---------------------------------------------------------------------------------

def read_text(path: str, text: str) -> ToolOutput:
    """`nvidia-smi -q` (the whole log or an excerpt of it)."""
    tree = _text_tree(text)
    out = _output(path, TEXT, _text_gpus(tree), tree)
    if not out.gpus:
        raise UsageError(f"{path} looks like nvidia-smi -q output but holds none of its GPU sections "
                         "(ECC Errors, Clocks, PCI, ...): was it cut short?")
    return out


def read_xml(path: str, text: str) -> ToolOutput:
    """`nvidia-smi -q -x`: a complete <nvidia_smi_log> document with one <gpu> per GPU."""
    if re.search(r"<!ENTITY", text):
        raise UsageError(f"{path} declares XML entities: expected nvidia-smi -q -x output, which has none")
    try:
        root = ET.fromstring(text.strip())
    except ET.ParseError as exc:
        raise UsageError(f"{path} is not a complete nvidia-smi -q -x XML ({exc}): was it cut short?") from None
    if root.tag != "nvidia_smi_log":
        raise UsageError(f"{path} has <{root.tag}> at its root: expected nvidia-smi -q -x's <nvidia_smi_log>")
    top: Tree = {child.tag: _xml_tree(child) for child in root if child.tag != "gpu"}
    gpus = [(element.get("id"), _section(_xml_tree(element))) for element in root.findall("gpu")]
    if not gpus:
        raise UsageError(f"{path} is nvidia-smi -q -x output with no <gpu> element: was it cut short?")
    return _output(path, XML, gpus, top)


def _section(tree: Union[str, Tree]) -> Tree:
    return tree if isinstance(tree, dict) else {}

"""`nvidia-smi nvlink --status` (`nvlink -s`, with or without `-i N`) read into the topology
probe's facts: per GPU its model, UUID and each link's state.

A link is up when nvidia-smi prints its speed (`Link 0: 25 GB/s`, `25.781 GB/s` on V100s) and
down when it prints `<inactive>`. What is at each link's far end (a GPU or an NVSwitch) and the
link's NVLink version are not printed, so they stay not known: the probe then compares each
GPU's active links with its same-model peers (TOP002) without guessing the fabric.
"""

from __future__ import annotations

import re
from typing import Optional

from ddpdoctor.core.errors import UsageError
from ddpdoctor.ingest.model import ToolOutput, not_known
from ddpdoctor.probes.topology.facts import GpuNode, GpuTopology, NodeFacts, NvLink, Placement, TopologyFacts

KIND = "nvlink-status"
PROBE = "topology"
_GPU = re.compile(r"^GPU (\d+): (.*?)\s*(?:\(UUID: ([^)]*)\))?\s*$")  # drivers before ~450 print no UUID
_LINK = re.compile(r"^\s*Link (\d+): (.*?)\s*$")
_UP = re.compile(r"\d+(\.\d+)? GB/s$")
_UUID = re.compile(r"(GPU|MIG)-[0-9a-fA-F-]{8,}$")
CANNOT_SHOW = ("what each NVLink connects to (a GPU or an NVSwitch) and its version (nvidia-smi nvlink -R, -v)",
               "each GPU pair's PCIe path and peer-to-peer status (nvidia-smi topo -m, topo -p2p r)",
               "PCIe link generation and width (nvidia-smi -q)",
               "CPU and NUMA affinity (nvidia-smi topo -m)",
               "the CPUs each rank runs on")


def _link(path: str, number: int, line: str, match: re.Match[str]) -> NvLink:
    """One `Link N:` line: its speed (up) or `<inactive>` (down); anything else is another output."""
    state = match.group(2)
    if state != "<inactive>" and not _UP.match(state):
        raise UsageError(f"{path}: line {number} ({line.strip()!r}) is not a link state: expected nvidia-smi "
                         "nvlink --status ('Link N: 25 GB/s' or 'Link N: <inactive>'), or it was cut short")
    unknown = not_known(KIND)
    return NvLink(link=int(match.group(1)), active=state != "<inactive>", version=unknown,
                  remote_bus_id=unknown, remote_type=unknown)


def _gpus(path: str, text: str) -> list[GpuNode]:
    """Each `GPU N: model (UUID: ...)` line with the link lines under it."""
    gpus: list[GpuNode] = []
    current: Optional[GpuNode] = None
    last_said = False  # the last GPU has a line under it (a link, "(Not supported)", "all links are inActive")
    for number, line in enumerate(text.splitlines(), 1):
        gpu = _GPU.match(line)
        if gpu:
            uuid = (gpu.group(3) or "").strip()
            current = GpuNode(index=int(gpu.group(1)), name=gpu.group(2), uuid=uuid if _UUID.match(uuid) else None)
            gpus.append(current)
            last_said = False
            continue
        link = _LINK.match(line)
        if link and current is not None:
            current.nvlinks.append(_link(path, number, line, link))
        last_said = last_said or (current is not None and bool(line.strip()))
    if len(gpus) > 1 and not last_said and any(g.nvlinks for g in gpus):
        raise UsageError(f"{path}: GPU {gpus[-1].index} lists no NVLink while the GPUs above it do: "
                         "the nvidia-smi nvlink --status output was cut short")
    return gpus


def read(path: str, text: str) -> ToolOutput:
    """Per GPU, its links' states; the node's GPU list sits on the first GPU's facts."""
    gpus = _gpus(path, text)
    out = ToolOutput(path=path, kind=KIND, cannot_show=list(CANNOT_SHOW))
    if not gpus:
        return out  # names no GPU: load says the file looks cut short
    node = NodeFacts(numa=not_known(KIND), gpus=GpuTopology(gpus=gpus))
    for offset, gpu in enumerate(gpus):
        index = int(gpu.index or 0)
        out.gpus[index] = {PROBE: TopologyFacts(gpu_uuid=gpu.uuid if isinstance(gpu.uuid, str) else None,
                                                placement=Placement(unknown=not_known(KIND)["unknown"]),
                                                node=node if offset == 0 else None, gpu_index=index)}
    return out

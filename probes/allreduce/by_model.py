"""What a GPU model's own interconnect gives an all-reduce inside one node, from its name alone.

Why: a measurement read from an nccl-tests output with no topology beside it still names its
GPUs, and each model has a best path between two of its GPUs that any healthy node of that
model offers: NVLink through NVSwitch on the SXM boards (H100/H200/B200 HGX, A100 SXM4), PCIe
peer-to-peer at the board's own generation, x16, on the others. Far below that on one node
means the data took a slower path (host memory instead of peer-to-peer, a link trained down).
Only one node is judged: across nodes the network sets the figure, and no name tells it.

The figure is the topology model's (ddpdoctor.judge.link_model: the hop's rate times NCCL's
usual efficiency), so a topology read beside the output, which knows the real links, replaces it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

from ddpdoctor.judge.link_model import EFFICIENCY, nvlink_gbps, nvlink_label, pcie_gbps

# (model name pattern, NVML's NVLink version code, links per GPU): boards whose every GPU reaches
# the others over all its links (NVSwitch). V100/P100 SXM2 are left out: their hybrid cube mesh
# gives a ring fewer links than the board has.
_NVSWITCH = ((re.compile(r"\bB200\b|\bGB200\b"), 7, 18),
             (re.compile(r"H100 80GB HBM3|H100 SXM|\bH200\b(?! NVL)"), 6, 18),
             (re.compile(r"A100[- ]SXM"), 5, 12))
# (model name pattern, the PCIe generation the board supports), newest first.
_PCIE_GEN = ((re.compile(r"H100|H200|\bH20\b|RTX 50\d0|RTX PRO 6000"), 5),
             (re.compile(r"A100|A800|\bA40\b|\bA30\b|\bA10G?\b|\bA16\b|\bA2\b|RTX 30\d0|RTX A\d000|\bL40S?\b|\bL4\b"
                         r"|\bL20\b|RTX 40\d0|RTX \d000 Ada"), 4),
             (re.compile(r"V100|\bT4\b|RTX 20\d0|TITAN RTX|Quadro RTX|P100|\bP40\b|TITAN V\b|GTX 10\d0"), 3))


def _nvswitch(name: str) -> Optional[dict[str, Any]]:
    for pattern, version, links in _NVSWITCH:
        if pattern.search(name):
            wire = nvlink_gbps(version, links)
            if wire:
                return {"gbps": round(wire * EFFICIENCY["nvlink"], 1),
                        "bottleneck": f"{nvlink_label(version)} x{links} of {name}, from its model name"}
    return None


def _pcie(name: str) -> Optional[dict[str, Any]]:
    for pattern, gen in _PCIE_GEN:
        if pattern.search(name):
            wire = pcie_gbps(gen, 16)
            if wire:
                return {"gbps": round(wire * EFFICIENCY["p2p"], 1),
                        "bottleneck": f"PCIe Gen{gen} x16 peer-to-peer of {name}, from its model name"}
    return None


def expected_from_model(names: Iterable[Optional[str]], hosts: Iterable[str]) -> dict[str, Any]:
    """The `expected_busbw` shape (probes/topology/checks.py) for GPUs known only by name: empty
    where the name says nothing firm (unknown or mixed models, one GPU, several nodes)."""
    models = [n for n in names if n]
    gpus, nodes = len(models), len(set(hosts))
    if gpus < 2 or nodes != 1 or len(set(models)) != 1:
        return {}
    name = models[0]
    found = _nvswitch(name) or _pcie(name)
    if found is None:
        return {}
    # No wire figure: a PCIe board may carry an NVLink bridge the name does not show, and busbw
    # above PCIe would then read as in-network reduction (BW007).
    return found | {"nodes": 1, "from_model": True,
                    "model": "the model's best path between two GPUs x efficiency (docs/probes/allreduce.md)"}

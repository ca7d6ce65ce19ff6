"""The environment variables that change how torch, NCCL, gloo or CUDA behave, as their projects document them.

Why a table: a rank that crashes in torch (a SIGSEGV in DDP's constructor, an abort in NCCL's init) is as often
made by a switch the user exported while debugging (TORCH_DISTRIBUTED_DEBUG=DETAIL, CUDA_LAUNCH_BLOCKING=1, an
NCCL_ALGO forced, an allocator setting) as by the code. The crash's own output never names the switch. So a crash
finding lists the ones the ranks ran with, and `check` tries the failing stage once more without them
(session/crash_retry.py). Only variables that change behaviour are here: not the mapping (CUDA_VISIBLE_DEVICES,
the homogeneity and GPU-count probes read it) nor the launcher's (MASTER_ADDR, RANK).

Sources (each entry names its own): torch's distributed docs (https://pytorch.org/docs/stable/distributed.html),
its ProcessGroupNCCL variables (https://pytorch.org/docs/stable/torch_nccl_environment_variables.html), its CUDA
notes (https://pytorch.org/docs/stable/notes/cuda.html), NCCL's environment variables
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) and CUDA's
(https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#cuda-environment-variables).
docs/runtime.md shows the table to users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ddpdoctor.core.redact import redact_value

_TORCH_DIST = "https://pytorch.org/docs/stable/distributed.html"
_TORCH_NCCL = "https://pytorch.org/docs/stable/torch_nccl_environment_variables.html"
_TORCH_CUDA = "https://pytorch.org/docs/stable/notes/cuda.html"
_NCCL = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
_CUDA = "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#cuda-environment-variables"


@dataclass(frozen=True)
class Setting:
    """One variable (or, ending in `*`, a family of them) and what setting it changes."""

    name: str
    project: str  # torch | NCCL | gloo | CUDA | allocator
    kind: str  # debug | blocking | transport | algorithm | allocator | error handling
    changes: str
    source: str

    def matches(self, name: str) -> bool:
        return name.startswith(self.name[:-1]) if self.name.endswith("*") else name == self.name


SETTINGS: tuple[Setting, ...] = (
    Setting("TORCH_DISTRIBUTED_DEBUG", "torch", "debug",
            "wraps every process group in a checking wrapper that runs extra collectives to compare each call's "
            "shapes and order across ranks (DETAIL), and logs more of DDP", _TORCH_DIST),
    Setting("TORCH_CPP_LOG_LEVEL", "torch", "debug", "c10's C++ log level", _TORCH_DIST),
    Setting("TORCH_SHOW_CPP_STACKTRACES", "torch", "debug", "C++ stack traces in every torch error", _TORCH_DIST),
    Setting("TORCH_NCCL_BLOCKING_WAIT", "torch", "blocking",
            "makes wait() block the host until the collective ends or times out", _TORCH_NCCL),
    Setting("NCCL_BLOCKING_WAIT", "torch", "blocking", "the old name of TORCH_NCCL_BLOCKING_WAIT", _TORCH_NCCL),
    Setting("TORCH_NCCL_ASYNC_ERROR_HANDLING", "torch", "error handling",
            "what the watchdog does on an NCCL error or timeout (0 nothing, 1 abort and tear down, 2 abort the "
            "communicator, 3 tear down: the default)", _TORCH_NCCL),
    Setting("NCCL_ASYNC_ERROR_HANDLING", "torch", "error handling",
            "the old name of TORCH_NCCL_ASYNC_ERROR_HANDLING", _TORCH_NCCL),
    Setting("TORCH_NCCL_DESYNC_DEBUG", "torch", "debug", "desync debugging in the watchdog", _TORCH_NCCL),
    Setting("TORCH_NCCL_ENABLE_TIMING", "torch", "debug", "start events on every collective, for its timing",
            _TORCH_NCCL),
    Setting("TORCH_NCCL_ENABLE_MONITORING", "torch", "error handling",
            "the thread that aborts the process when the watchdog stops beating", _TORCH_NCCL),
    Setting("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "torch", "error handling",
            "how long the monitor waits for the watchdog before it aborts the process", _TORCH_NCCL),
    Setting("TORCH_NCCL_TRACE_BUFFER_SIZE", "torch", "debug", "the Flight Recorder's ring of collectives",
            _TORCH_NCCL),
    Setting("TORCH_NCCL_DUMP_ON_TIMEOUT", "torch", "debug", "a Flight Recorder dump on a timeout", _TORCH_NCCL),
    Setting("TORCH_NCCL_AVOID_RECORD_STREAMS", "torch", "allocator",
            "how the caching allocator keeps collectives' tensors alive", _TORCH_NCCL),
    Setting("TORCH_NCCL_HIGH_PRIORITY", "torch", "transport", "a high-priority stream for NCCL", _TORCH_NCCL),
    Setting("TORCH_NCCL_USE_COMM_NONBLOCKING", "torch", "blocking", "NCCL's non-blocking communicators",
            _TORCH_NCCL),
    Setting("TORCH_USE_CUDA_DSA", "torch", "debug", "device-side assertions in torch's kernels", _TORCH_CUDA),
    Setting("PYTORCH_CUDA_ALLOC_CONF", "allocator", "allocator",
            "the CUDA caching allocator (expandable segments, split sizes, garbage collection)", _TORCH_CUDA),
    Setting("PYTORCH_ALLOC_CONF", "allocator", "allocator", "the newer name of PYTORCH_CUDA_ALLOC_CONF",
            _TORCH_CUDA),
    Setting("PYTORCH_NO_CUDA_MEMORY_CACHING", "allocator", "allocator",
            "turns the CUDA caching allocator off (every allocation a cudaMalloc)", _TORCH_CUDA),
    Setting("LD_PRELOAD", "allocator", "allocator",
            "libraries loaded before every other (a malloc replacement: jemalloc, tcmalloc)",
            "https://man7.org/linux/man-pages/man8/ld.so.8.html"),
    Setting("MALLOC_CONF", "allocator", "allocator", "jemalloc's settings",
            "https://jemalloc.net/jemalloc.3.html"),
    Setting("CUDA_LAUNCH_BLOCKING", "CUDA", "blocking", "every kernel launch waits for the kernel to end", _CUDA),
    Setting("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA", "transport", "the hardware queues kernels are launched on",
            _CUDA),
    Setting("CUDA_MODULE_LOADING", "CUDA", "debug", "lazy or eager loading of kernels", _CUDA),
    Setting("CUDA_CACHE_DISABLE", "CUDA", "debug", "the JIT cache of PTX kernels", _CUDA),
    Setting("GLOO_SOCKET_IFNAME", "gloo", "transport", "the network interface gloo binds", _TORCH_DIST),
    Setting("GLOO_DEVICE_TRANSPORT", "gloo", "transport", "gloo's transport (tcp, uv)", _TORCH_DIST),
    Setting("TORCH_GLOO_LAZY_INIT", "gloo", "transport", "gloo's connections made at first use", _TORCH_DIST),
    Setting("NCCL_DEBUG", "NCCL", "debug", "NCCL's logging (INFO, TRACE)", _NCCL),
    Setting("NCCL_DEBUG_SUBSYS", "NCCL", "debug", "which parts of NCCL log", _NCCL),
    Setting("NCCL_ALGO", "NCCL", "algorithm", "the collective algorithms NCCL may use (Ring, Tree, NVLS...)", _NCCL),
    Setting("NCCL_PROTO", "NCCL", "algorithm", "the protocols NCCL may use (LL, LL128, Simple)", _NCCL),
    Setting("NCCL_P2P_DISABLE", "NCCL", "transport", "GPU-to-GPU transfers over NVLink or PCIe", _NCCL),
    Setting("NCCL_P2P_LEVEL", "NCCL", "transport", "how far apart two GPUs may be for P2P", _NCCL),
    Setting("NCCL_SHM_DISABLE", "NCCL", "transport", "the shared-memory transport between processes", _NCCL),
    Setting("NCCL_IB_DISABLE", "NCCL", "transport", "InfiniBand/RoCE (sockets instead)", _NCCL),
    Setting("NCCL_NET", "NCCL", "transport", "which network plugin or transport NCCL uses", _NCCL),
    Setting("NCCL_NET_GDR_LEVEL", "NCCL", "transport", "GPUDirect RDMA between the NIC and the GPU", _NCCL),
    Setting("NCCL_SOCKET_IFNAME", "NCCL", "transport", "the interfaces NCCL's sockets use", _NCCL),
    Setting("NCCL_IB_HCA", "NCCL", "transport", "which InfiniBand adapters NCCL uses", _NCCL),
    Setting("NCCL_CUMEM_ENABLE", "NCCL", "allocator", "NCCL's cuMem-based buffers", _NCCL),
    Setting("NCCL_NVLS_ENABLE", "NCCL", "algorithm", "NVLink SHARP (NVLS)", _NCCL),
    Setting("NCCL_COLLNET_ENABLE", "NCCL", "algorithm", "CollNet (in-network reductions)", _NCCL),
    Setting("NCCL_BUFFSIZE", "NCCL", "transport", "the size of NCCL's buffers between ranks", _NCCL),
    Setting("NCCL_NTHREADS", "NCCL", "algorithm", "CUDA threads a channel uses", _NCCL),
    Setting("NCCL_MIN_NCHANNELS", "NCCL", "algorithm", "the least channels NCCL uses", _NCCL),
    Setting("NCCL_MAX_NCHANNELS", "NCCL", "algorithm", "the most channels NCCL uses", _NCCL),
    Setting("NCCL_LAUNCH_MODE", "NCCL", "blocking", "how NCCL launches its kernels (PARALLEL, GROUP)", _NCCL),
    Setting("NCCL_TOPO_FILE", "NCCL", "transport", "a topology file read instead of the machine's", _NCCL),
    Setting("NCCL_GRAPH_FILE", "NCCL", "algorithm", "a graph file that fixes NCCL's rings and trees", _NCCL),
)


def setting_for(name: str) -> Optional[Setting]:
    return next((s for s in SETTINGS if s.matches(name)), None)


def behaviour_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` the table knows, sorted, their values redacted where they look secret."""
    return {name: redact_value(name, value) for name, value in sorted(environ.items())
            if value != "" and setting_for(name) is not None}


def said(settings: Mapping[str, str]) -> str:
    """`TORCH_DISTRIBUTED_DEBUG=DETAIL, CUDA_LAUNCH_BLOCKING=1`."""
    return ", ".join(f"{name}={value}" for name, value in settings.items())

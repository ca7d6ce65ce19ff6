"""What each log-found cause means and what to do: the words users search for.

Kept apart from the diagnosis logic so docs/explain.md and this table can be read side by
side. Codes shared with the live probes (RUN, GPU) mean the same thing there; LOG codes
are failures only a job's own log shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ddpdoctor.core.codes import CODES
from ddpdoctor.core.findings import Severity


@dataclass(frozen=True)
class CauseText:
    code: str
    severity: Severity
    title: str  # {ranks}, {nodes} and the event's fields are filled in
    why: str
    fix: str


def _catalogued(code: str, title: str) -> CauseText:
    """A cause in its code's one wording (ddpdoctor/core/codes.py): only the title is the log's."""
    entry = CODES[code]
    return CauseText(code, entry.severity, title, entry.why, entry.fix)


def _worded(code: str, title: str, why: str, fix: str, severity: Optional[Severity] = None) -> CauseText:
    """A cause of a code the catalogue words per case: this case's why and fix, the catalogue's
    severity (or, where it allows several, the one given)."""
    return CauseText(code, CODES[code].allowed(severity), title, why, fix)


CAUSES: dict[str, CauseText] = {
    "python_exception": _worded(
        "RUN003", "{where} failed: {text}",
        "An exception ended this rank; the ranks waiting for it in the next collective could not go on.",
        "Fix the error shown (the traceback above it in the log names the line); the other ranks' timeouts "
        "and closed connections are its consequence."),
    "cuda_oom": _catalogued("LOG001", "CUDA out of memory{on}"),
    "invalid_device_ordinal": _worded(
        "GPU005", "{where} asked for a GPU that does not exist (invalid device ordinal)",
        "The rank selected a device index larger than the GPUs it can see. Under Slurm with --gpus-per-task=1 or "
        "--gpu-bind, each task sees only its own GPU as cuda:0, so cuda:LOCAL_RANK is out of range.",
        "Use torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) only when every GPU of the node is visible; "
        "with one GPU per task, use cuda:0 (or device_count()-aware mapping). `ddpdoctor check` under the same "
        "srun shows what each rank sees (GPU005, GPU006).", severity=Severity.CRITICAL),
    "driver_too_old": _worded(
        "GPU008", "The NVIDIA driver is too old for this torch{on}: {driver}",
        "torch's CUDA runtime needs a newer driver than the node has: the driver states the newest CUDA it "
        "supports (`nvidia-smi`, top right), and torch was built for a newer one (`torch.version.cuda`). "
        "Worded \"The NVIDIA driver on your system is too old (found version N)\" by torch (N = 1000 x major + "
        "10 x minor: 12080 is CUDA 12.8) and \"CUDA driver version is insufficient for CUDA runtime version\" "
        "(error 35) by the CUDA runtime, NCCL and older torch.",
        "Install a torch build for the CUDA the driver supports (the cuXXX wheel at or below `nvidia-smi`'s "
        "CUDA version), or update the node's driver; where only some nodes fail, those nodes' drivers are "
        "older (`ddpdoctor check` compares them: GPU008, HOM)."),
    "ptx_toolchain": _worded(
        "GPU008", "A CUDA kernel{on} was built by a newer CUDA toolkit than the driver supports",
        "\"the provided PTX was compiled with an unsupported toolchain\" (cudaErrorUnsupportedPtxVersion, 222): "
        "the driver compiles a kernel's PTX at load time and refuses PTX from a toolkit newer than itself: a "
        "Triton or torch.compile kernel, a custom extension built with a newer nvcc, a library shipping PTX only.",
        "Update the node's driver to one that supports the toolkit's CUDA (`nvidia-smi` shows the newest it "
        "supports, `nvcc --version` the toolkit's); or build the extension with a toolkit the driver supports, "
        "with SASS for the GPU (TORCH_CUDA_ARCH_LIST)."),
    "no_gpu": _worded(
        "GPU008", "torch cannot use a GPU{on}: {what}",
        "CUDA could not start: no GPU is visible to the process (CUDA_VISIBLE_DEVICES empty, no GPU granted by "
        "the scheduler) or the driver is not loaded.",
        "Check `nvidia-smi` and CUDA_VISIBLE_DEVICES on that node, and the job's GPU request (--gres=gpu:N, "
        "--gpus-per-task)."),
    "cuda_fatal": _catalogued("LOG009", "CUDA error{on}: {what}"),
    "cuda_runtime_error": _catalogued("LOG009", "CUDA error{on}: {what} (cuda runtime error {code})"),
    # NCCL's WARN under torch's generic `unhandled cuda error`: the CUDA call's own error, in NCCL's words.
    "nccl_cuda_oom": _catalogued("LOG001", "CUDA out of memory{on} (NCCL WARN Cuda failure 'out of memory': NCCL "
                                           "could not allocate its buffers)"),
    "nccl_cuda_failure": _catalogued("LOG009", "CUDA error{on}: {what} (NCCL WARN Cuda failure)"),
    "nccl_ipc_failure": _catalogued("LOG009", "CUDA error{on}: {what} (NCCL's P2P transport could not open a peer "
                                              "GPU's memory; NCCL_P2P_DISABLE=1 avoids it)"),
    "nccl_unhandled_cuda": _catalogued("LOG009", "CUDA error{on}: NCCL's unhandled cuda error (NCCL_DEBUG=WARN "
                                                 "prints which CUDA call failed)"),
    "driver_mismatch": _worded(
        "GPU008", "The NVIDIA kernel driver and the CUDA driver library do not match{on} (CUDA error 803)",
        "\"system has unsupported display driver / cuda driver combination\" (cudaErrorSystemDriverMismatch, 803): "
        "the loaded kernel module and the user-space libcuda are different versions: a driver updated without a "
        "reboot, or a container that brings its own libcuda (a CUDA forward-compatibility package) on a GPU or "
        "driver that does not support it.",
        "Compare `cat /proc/driver/nvidia/version` with the libcuda.so the process loads (`nvidia-smi` fails with "
        "\"Driver/library version mismatch\" in the same state); reboot the node after a driver update, or remove "
        "the container's cuda-compat libraries."),
    "duplicate_gpu": _worded(
        "GPU003", "Ranks share one GPU{on} (NCCL: Duplicate GPU detected, bus id {busid})",
        "NCCL refuses two ranks of one communicator on one GPU (\"Duplicate GPU detected\", ncclInvalidUsage). "
        "The ranks did not call torch.cuda.set_device(local_rank), or CUDA_VISIBLE_DEVICES gives them the same GPU.",
        "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group (or pass device_id=), "
        "and launch no more ranks per node than GPUs. `ddpdoctor check` names the ranks per GPU."),
    "same_gpu_partition": _worded(
        "GPU003", "Ranks share one GPU{on} (NCCL: Multiple Ranks are using the same GPU)",
        "NCCL refuses two ranks of one communicator on one GPU (\"Multiple Ranks are using the same GPU\"). "
        "The ranks did not call torch.cuda.set_device(local_rank), or CUDA_VISIBLE_DEVICES gives them the same GPU.",
        "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group, and launch no more "
        "ranks per node than GPUs."),
    "nccl_system_error": _worded(
        "LOG007", "NCCL network error{on} (unhandled system error)",
        "NCCL's sockets or network plugin failed: most often the wrong network interface (a docker or virtual "
        "bridge, an interface that does not route between the nodes), a firewall, or a peer that died.",
        "Rerun with NCCL_DEBUG=INFO and read the `NET/Socket : Using` line on each node; set NCCL_SOCKET_IFNAME to "
        "the interface that connects the nodes (e.g. NCCL_SOCKET_IFNAME=eth0, or ^docker0,lo to exclude), and "
        "open the ports between nodes."),
    "nccl_shm_error": _worded(
        "LOG007", "NCCL could not create its shared-memory segment in /dev/shm{on}",
        "NCCL's shared-memory transport between the GPUs of one node could not create its segment in /dev/shm: "
        "/dev/shm is too small or full (a container's default is 64 MB) or not writable. It is the node's (the "
        "container's) setting, so every rank there fails the same way.",
        "Give the container a larger /dev/shm (docker --shm-size=16g or --ipc=host; on Kubernetes an emptyDir "
        "with medium: Memory mounted at /dev/shm), free it (`df -h /dev/shm`), or set NCCL_SHM_DISABLE=1."),
    "nccl_socket_failed": _worded(
        "LOG007", "NCCL lost its socket to {addr}{on}: {err}",
        "NCCL's socket transport or bootstrap failed a send or receive: the peer process at that address died (its "
        "own first error, in its log, is then the cause) or the network between the two hosts dropped the "
        "connection.",
        "Read the log of the rank at that address for an error before this one; if it has none, check the link "
        "between the two hosts, the firewall, and that NCCL_SOCKET_IFNAME names an interface that routes between "
        "the nodes."),
    "nccl_ib_verbs": _worded(
        "LOG007", "An InfiniBand verbs call failed{on}: {call}: {err}",
        "NCCL's IB transport could not set up a queue pair to its peer. \"Network is unreachable\" from "
        "ibv_modify_qp is usually the wrong RoCE GID (NCCL_IB_GID_INDEX) or an HCA port without a route to the "
        "peer's subnet; a port that is down fails the same way.",
        "Check `ibstat`/`ibv_devinfo` (port state Active) and `show_gids` on both hosts; on RoCE set "
        "NCCL_IB_GID_INDEX to the RoCE v2 GID with an address on the peers' subnet; restrict NCCL_IB_HCA to ports "
        "that are cabled."),
    "nccl_no_interface": _worded(
        "LOG007", "NCCL found no usable network interface{on}",
        "NCCL_SOCKET_IFNAME names an interface the node does not have, or every interface was excluded.",
        "List the node's interfaces (`ip -br addr`) and set NCCL_SOCKET_IFNAME to one that exists on every node."),
    "nccl_ib_error": _worded(
        "LOG007", "InfiniBand/RoCE transport error{on} (error {code})",
        "The IB verbs transport failed a work request. Error 12 (transport retry exceeded) on RoCE is usually a "
        "wrong GID index or a link or switch problem between the two peers.",
        "On RoCE set NCCL_IB_GID_INDEX (often 3) to the RoCE v2 GID; check `ibstat` and link errors on both hosts; "
        "NCCL_IB_DISABLE=1 tells a network fault from an IB-only one."),
    "nccl_heartbeat_stuck": _catalogued("LOG010", "NCCL's watchdog thread itself got stuck{on}"),
    "clients_joined": _worded(
        "RUN001", "Only {joined} of {expected} ranks joined the rendezvous",
        "The store on MASTER_ADDR:MASTER_PORT waited for every rank and some never connected: fewer processes "
        "were launched than WORLD_SIZE, they crashed before init, or they could not reach MASTER_ADDR (another "
        "address or port, a firewall, MASTER_ADDR=localhost on a multi-node job).",
        "Check that WORLD_SIZE equals nodes x processes per node, that every node uses the same MASTER_ADDR and "
        "MASTER_PORT, and that the port is open (`nc -zv MASTER_ADDR MASTER_PORT` from another node)."),
    "rdzv_timeout": _worded(
        "RUN001", "The elastic rendezvous timed out{on}: not every node arrived",
        "torchrun's c10d rendezvous waits for --nnodes agents; some never connected to --rdzv-endpoint in time.",
        "Start torchrun on every node with the same --rdzv-id, --rdzv-endpoint and --nnodes; check that the "
        "endpoint host and port are reachable from every node; raise --rdzv-conf join_timeout if nodes start late."),
    "store_barrier_timeout": _worded(
        "RUN001", "Only {joined} of {expected} ranks reached init_process_group's store-based barrier",
        "init_process_group ends with a barrier in the store (torch 1.8-2.0): every rank adds itself to a counter "
        "and waits for world_size. The count stayed short: some ranks were not launched, crashed before init, are "
        "still loading, or use another MASTER_ADDR/MASTER_PORT (or another group's key).",
        "Check that every rank was started (WORLD_SIZE = nodes x processes per node) and reached "
        "init_process_group/new_group; read the missing ranks' logs for an earlier error. A count above world_size "
        "means another job's keys share this store: give each job its own MASTER_PORT."),
    "ncclid_timeout": _catalogued("RUN004", "Rank {missing} never set up its NCCL communicator: {where} timed out "
                                            "waiting for the id it publishes in the store"),
    "store_key_rank_timeout": _catalogued("RUN004", "Rank {missing} never published its store key {key}: {where} "
                                                    "timed out waiting for it"),
    "address_in_use": _catalogued("LOG005", "The rendezvous port {port} is already in use{on}"),
    "connect_timeout": _worded(
        "LOG006", "{where} could not reach the rendezvous store at {addr}:{port}",
        "Connecting to MASTER_ADDR:MASTER_PORT timed out: the address is wrong (localhost on another node), the "
        "port differs between nodes, the store was never started (rank 0 failed) or a firewall drops the traffic.",
        "Check MASTER_ADDR/MASTER_PORT on every node (the same value everywhere, an address other nodes can "
        "route to), that rank 0 started, and `nc -zv ADDR PORT` from this node."),
    "store_get_error": _worded(
        "LOG006", "{where} lost the connection to the store while fetching NCCL's id from rank {from_rank} ({err})",
        "The rank asked the c10d store (hosted with rank 0 or its launcher) for NCCL's id and the store's connection "
        "broke: rank 0 or its node crashed first (its error is in its own log), or the network between nodes dropped.",
        "Read rank 0's node's log for its first error (a crash there is the cause); if it shows none, check the "
        "network between the nodes and MASTER_ADDR/MASTER_PORT."),
    "store_host_unknown": _worded(
        "LOG006", "{where} could not resolve the store's host name ({err})",
        "MASTER_ADDR (or --rdzv-endpoint) names a host that does not resolve: a typo, or, on Kubernetes, the "
        "master pod's service does not exist yet when the worker starts.",
        "Check MASTER_ADDR on every rank; on Kubernetes let workers retry until the master's service resolves "
        "(restartPolicy OnFailure, an init container that waits for it)."),
    "store_reset_at_init": _worded(
        "LOG006", "{where} lost the connection to the store during init_process_group ({err})",
        "init_process_group's rendezvous store (MASTER_ADDR:MASTER_PORT) reset the connection: the master was "
        "restarting or not ready, another job holds that port, or a proxy or firewall cut the connection.",
        "Check that the master's process was up and listening on MASTER_PORT when this rank started, and that "
        "no other job uses the port."),
    "rdzv_connection": _worded(
        "LOG006", "{where} could not reach the elastic rendezvous store",
        "torchrun could not connect to --rdzv-endpoint: wrong host or port, or its host is down or firewalled.",
        "Check that --rdzv-endpoint names a host and port reachable from every node, and that it is the same "
        "on every node."),
    "slurm_oom": _worded(
        "RUN002", "The kernel's out-of-memory killer ended a task of {where}",
        "Slurm's cgroup counted an out-of-memory kill: the job used more host memory than it was granted.",
        "Ask for more memory (--mem, --mem-per-gpu), use fewer DataLoader workers or a smaller prefetch, or "
        "avoid loading the whole dataset on every rank."),
    "slurm_cancelled": _catalogued("LOG008", "Slurm cancelled the job{on} ({why})"),
    "dataloader_killed": _worded(
        "LOG002", "A DataLoader worker of {where} was killed ({signal})",
        "A worker process died by a signal; 'Killed' is most often the kernel's out-of-memory killer (each "
        "worker holds a copy of what the dataset object holds).",
        "Lower num_workers or prefetch_factor, keep big arrays out of the Dataset object (memory-map them), "
        "and check `dmesg | grep -i oom` on that node."),
    "dataloader_shm": _worded(
        "LOG002", "DataLoader workers of {where} ran out of shared memory (/dev/shm)",
        "Workers pass batches through /dev/shm; a container's default 64 MB fills at once.",
        "Run the container with a larger /dev/shm (docker --shm-size=16g or --ipc=host), or lower num_workers."),
    "dataloader_exited": _worded(
        "LOG002", "A DataLoader worker of {where} exited unexpectedly",
        "A worker process died without a Python error of its own: killed, a segfault in a native library, or "
        "out of shared memory.",
        "Rerun with num_workers=0 to see the error in the main process; check `dmesg` for OOM kills."),
    "dataloader_timeout": _worded(
        "LOG002", "The DataLoader of {where} timed out after {seconds} s",
        "No batch arrived within the DataLoader's timeout: a worker is stuck (I/O, a lock, a deadlock after fork).",
        "Find the stuck worker with `py-spy dump --pid WORKER_PID`; avoid threads and open connections in the "
        "Dataset before workers fork (use worker_init_fn)."),
    "ddp_unused_params": _catalogued("LOG003", "DDP found parameters without gradients{on}"),
    "ddp_model_mismatch": _catalogued("LOG004", "The model differs across ranks{on}"),
    "launcher_signal": _catalogued("LOG015", "The launcher received {signal} and stopped its workers{on}"),
}

# A worker's end by a signal, by what the signal usually means (ddpdoctor/explain/launchers.py).
SIGNAL_CAUSES: dict[str, CauseText] = {
    "SIGKILL": _catalogued("LOG012", "{where} was killed (SIGKILL)"),
    "SIGSEGV": _catalogued("LOG013", "{where} crashed with a segmentation fault (SIGSEGV)"),
    "SIGABRT": _catalogued("LOG014", "{where} aborted (SIGABRT)"),
}

SIGNAL_CRASH = _worded(
    "RUN002", "{where} was killed ({signal})",
    "The process ended by a signal, with no Python error of its own. SIGKILL with no error is most often the "
    "kernel's out-of-memory killer; SIGSEGV or SIGABRT a crash in native code.",
    "Check `dmesg | grep -i -E 'oom|killed process'` on that host; if memory is short, run fewer ranks per node, "
    "fewer DataLoader workers or a smaller batch.")

EXIT_CRASH = _worded(
    "RUN002", "{where} exited with code {exitcode}",
    "The process ended with an error exit code, but its log holds no Python error: the error went to another "
    "file (torchrun --log-dir, --redirects) or the program exited on purpose.",
    "Read that rank's own output (torchrun's --log-dir, or the elastic error_file) for the reason.")

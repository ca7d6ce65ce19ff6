"""What each log-found cause means and what to do: the words users search for.

Kept apart from the diagnosis logic so docs/explain.md and this table can be read side by
side. Codes shared with the live probes (RUN, GPU) mean the same thing there; LOG codes
are failures only a job's own log shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpdoctor.core.findings import Severity


@dataclass(frozen=True)
class CauseText:
    code: str
    severity: Severity
    title: str  # {ranks}, {nodes} and the event's fields are filled in
    why: str
    fix: str


_OOM_FIX = ("Lower the per-GPU batch size or sequence length, enable activation checkpointing or mixed precision; "
            "if only some ranks run out, look for extra work or tensors on those ranks (rank 0 evaluation, "
            "metrics gathered to one rank) and for other ranks' CUDA contexts on their GPU (a missing "
            "torch.cuda.set_device(local_rank)); `ddpdoctor check` shows contexts per GPU (GPU004).")

CAUSES: dict[str, CauseText] = {
    "python_exception": CauseText(
        "RUN003", Severity.CRITICAL, "{where} failed: {text}",
        "An exception ended this rank; the ranks waiting for it in the next collective could not go on.",
        "Fix the error shown (the traceback above it in the log names the line); the other ranks' timeouts "
        "and closed connections are its consequence."),
    "cuda_oom": CauseText(
        "LOG001", Severity.CRITICAL, "CUDA out of memory{on}",
        "The caching allocator could not get the memory it asked for on this GPU. When only some ranks run out, "
        "those ranks hold more than the others: more data, rank-0-only work, or another rank's context on their GPU.",
        _OOM_FIX),
    "invalid_device_ordinal": CauseText(
        "GPU005", Severity.CRITICAL, "{where} asked for a GPU that does not exist (invalid device ordinal)",
        "The rank selected a device index larger than the GPUs it can see. Under Slurm with --gpus-per-task=1 or "
        "--gpu-bind, each task sees only its own GPU as cuda:0, so cuda:LOCAL_RANK is out of range.",
        "Use torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) only when every GPU of the node is visible; "
        "with one GPU per task, use cuda:0 (or device_count()-aware mapping). `ddpdoctor check` under the same "
        "srun shows what each rank sees (GPU005, GPU006)."),
    "driver_too_old": CauseText(
        "GPU008", Severity.CRITICAL, "The NVIDIA driver is too old for this torch{on}",
        "torch's CUDA runtime needs a newer driver than the node has (found version {found}).",
        "Install a torch build for an older CUDA (the cuXXX wheel matching `nvidia-smi`'s CUDA version), or "
        "update the node's driver."),
    "no_gpu": CauseText(
        "GPU008", Severity.CRITICAL, "torch cannot use a GPU{on}: {what}",
        "CUDA could not start: no GPU is visible to the process (CUDA_VISIBLE_DEVICES empty, no GPU granted by "
        "the scheduler) or the driver is not loaded.",
        "Check `nvidia-smi` and CUDA_VISIBLE_DEVICES on that node, and the job's GPU request (--gres=gpu:N, "
        "--gpus-per-task)."),
    "cuda_fatal": CauseText(
        "LOG009", Severity.CRITICAL, "CUDA error{on}: {what}",
        "A kernel failed on the GPU. An illegal memory access or a device-side assert is a bug in the model or a "
        "custom kernel (an index out of range in an embedding or loss is the usual one); an ECC error is faulty "
        "hardware. The CUDA context is unusable afterwards, so every later call fails too.",
        "Rerun with CUDA_LAUNCH_BLOCKING=1 to get the failing line; for device-side asserts, run one step on CPU "
        "to see the Python error. For ECC errors, drain the node and run `ddpdoctor check` (HOM007)."),
    "duplicate_gpu": CauseText(
        "GPU003", Severity.CRITICAL, "Ranks share one GPU{on} (NCCL: Duplicate GPU detected, bus id {busid})",
        "NCCL refuses two ranks of one communicator on one GPU (\"Duplicate GPU detected\", ncclInvalidUsage). "
        "The ranks did not call torch.cuda.set_device(local_rank), or CUDA_VISIBLE_DEVICES gives them the same GPU.",
        "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group (or pass device_id=), "
        "and launch no more ranks per node than GPUs. `ddpdoctor check` names the ranks per GPU."),
    "same_gpu_partition": CauseText(
        "GPU003", Severity.CRITICAL, "Ranks share one GPU{on} (NCCL: Multiple Ranks are using the same GPU)",
        "NCCL refuses two ranks of one communicator on one GPU (\"Multiple Ranks are using the same GPU\"). "
        "The ranks did not call torch.cuda.set_device(local_rank), or CUDA_VISIBLE_DEVICES gives them the same GPU.",
        "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group, and launch no more "
        "ranks per node than GPUs."),
    "nccl_system_error": CauseText(
        "LOG007", Severity.CRITICAL, "NCCL network error{on} (unhandled system error)",
        "NCCL's sockets or network plugin failed: most often the wrong network interface (a docker or virtual "
        "bridge, an interface that does not route between the nodes), a firewall, or a peer that died.",
        "Rerun with NCCL_DEBUG=INFO and read the `NET/Socket : Using` line on each node; set NCCL_SOCKET_IFNAME to "
        "the interface that connects the nodes (e.g. NCCL_SOCKET_IFNAME=eth0, or ^docker0,lo to exclude), and "
        "open the ports between nodes."),
    "nccl_no_interface": CauseText(
        "LOG007", Severity.CRITICAL, "NCCL found no usable network interface{on}",
        "NCCL_SOCKET_IFNAME names an interface the node does not have, or every interface was excluded.",
        "List the node's interfaces (`ip -br addr`) and set NCCL_SOCKET_IFNAME to one that exists on every node."),
    "nccl_ib_error": CauseText(
        "LOG007", Severity.CRITICAL, "InfiniBand/RoCE transport error{on} (error {code})",
        "The IB verbs transport failed a work request. Error 12 (transport retry exceeded) on RoCE is usually a "
        "wrong GID index or a link or switch problem between the two peers.",
        "On RoCE set NCCL_IB_GID_INDEX (often 3) to the RoCE v2 GID; check `ibstat` and link errors on both hosts; "
        "NCCL_IB_DISABLE=1 tells a network fault from an IB-only one."),
    "nccl_heartbeat_stuck": CauseText(
        "LOG010", Severity.CRITICAL, "NCCL's watchdog thread itself got stuck{on}",
        "The thread that watches collectives stopped making progress, which happens when a CUDA or NCCL call "
        "blocks inside the driver (a hung GPU, a stuck NVLink/PCIe transfer), not a Python-level hang.",
        "Check the node's GPUs (`nvidia-smi`, `dmesg | grep -i xid`); collect the Flight Recorder dump "
        "(TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT=1) to see the last collective."),
    "clients_joined": CauseText(
        "RUN001", Severity.CRITICAL, "Only {joined} of {expected} ranks joined the rendezvous",
        "The store on MASTER_ADDR:MASTER_PORT waited for every rank and some never connected: fewer processes "
        "were launched than WORLD_SIZE, they crashed before init, or they could not reach MASTER_ADDR (another "
        "address or port, a firewall, MASTER_ADDR=localhost on a multi-node job).",
        "Check that WORLD_SIZE equals nodes x processes per node, that every node uses the same MASTER_ADDR and "
        "MASTER_PORT, and that the port is open (`nc -zv MASTER_ADDR MASTER_PORT` from another node)."),
    "rdzv_timeout": CauseText(
        "RUN001", Severity.CRITICAL, "The elastic rendezvous timed out{on}: not every node arrived",
        "torchrun's c10d rendezvous waits for --nnodes agents; some never connected to --rdzv-endpoint in time.",
        "Start torchrun on every node with the same --rdzv-id, --rdzv-endpoint and --nnodes; check that the "
        "endpoint host and port are reachable from every node; raise --rdzv-conf join_timeout if nodes start late."),
    "address_in_use": CauseText(
        "LOG005", Severity.CRITICAL, "The rendezvous port {port} is already in use{on}",
        "The store could not listen on MASTER_PORT (EADDRINUSE): another job on this node uses the port, or a "
        "previous run's process is still alive.",
        "Pick a free MASTER_PORT per job (torchrun --master-port, or --rdzv-endpoint host:0 with standalone), or "
        "find the holder with `ss -ltnp 'sport = :PORT'` and stop it."),
    "connect_timeout": CauseText(
        "LOG006", Severity.CRITICAL, "{where} could not reach the rendezvous store at {addr}:{port}",
        "Connecting to MASTER_ADDR:MASTER_PORT timed out: the address is wrong (localhost on another node), the "
        "port differs between nodes, the store was never started (rank 0 failed) or a firewall drops the traffic.",
        "Check MASTER_ADDR/MASTER_PORT on every node (the same value everywhere, an address other nodes can "
        "route to), that rank 0 started, and `nc -zv ADDR PORT` from this node."),
    "rdzv_connection": CauseText(
        "LOG006", Severity.CRITICAL, "{where} could not reach the elastic rendezvous store",
        "torchrun could not connect to --rdzv-endpoint: wrong host or port, or its host is down or firewalled.",
        "Check that --rdzv-endpoint names a host and port reachable from every node, and that it is the same "
        "on every node."),
    "slurm_oom": CauseText(
        "RUN002", Severity.CRITICAL, "The kernel's out-of-memory killer ended a task of {where}",
        "Slurm's cgroup counted an out-of-memory kill: the job used more host memory than it was granted.",
        "Ask for more memory (--mem, --mem-per-gpu), use fewer DataLoader workers or a smaller prefetch, or "
        "avoid loading the whole dataset on every rank."),
    "slurm_cancelled": CauseText(
        "LOG008", Severity.CRITICAL, "Slurm cancelled the job{on} ({why})",
        "The scheduler stopped the job (time limit, preemption or scancel); the ranks' errors after it are fallout.",
        "Ask for more time (--time), checkpoint and resume, or requeue on preemption (--requeue)."),
    "dataloader_killed": CauseText(
        "LOG002", Severity.CRITICAL, "A DataLoader worker of {where} was killed ({signal})",
        "A worker process died by a signal; 'Killed' is most often the kernel's out-of-memory killer (each "
        "worker holds a copy of what the dataset object holds).",
        "Lower num_workers or prefetch_factor, keep big arrays out of the Dataset object (memory-map them), "
        "and check `dmesg | grep -i oom` on that node."),
    "dataloader_shm": CauseText(
        "LOG002", Severity.CRITICAL, "DataLoader workers of {where} ran out of shared memory (/dev/shm)",
        "Workers pass batches through /dev/shm; a container's default 64 MB fills at once.",
        "Run the container with a larger /dev/shm (docker --shm-size=16g or --ipc=host), or lower num_workers."),
    "dataloader_exited": CauseText(
        "LOG002", Severity.CRITICAL, "A DataLoader worker of {where} exited unexpectedly",
        "A worker process died without a Python error of its own: killed, a segfault in a native library, or "
        "out of shared memory.",
        "Rerun with num_workers=0 to see the error in the main process; check `dmesg` for OOM kills."),
    "dataloader_timeout": CauseText(
        "LOG002", Severity.CRITICAL, "The DataLoader of {where} timed out after {seconds} s",
        "No batch arrived within the DataLoader's timeout: a worker is stuck (I/O, a lock, a deadlock after fork).",
        "Find the stuck worker with `py-spy dump --pid WORKER_PID`; avoid threads and open connections in the "
        "Dataset before workers fork (use worker_init_fn)."),
    "ddp_unused_params": CauseText(
        "LOG003", Severity.CRITICAL, "DDP found parameters without gradients{on}",
        "Some parameters took no part in the loss in the previous iteration, so DDP's reducer never finished "
        "that iteration's all-reduce (\"Expected to have finished reduction in the prior iteration\").",
        "Pass find_unused_parameters=True to DistributedDataParallel (it costs a graph traversal per step), or "
        "make every parameter part of the loss each step; TORCH_DISTRIBUTED_DEBUG=INFO names the parameters."),
    "ddp_model_mismatch": CauseText(
        "LOG004", Severity.CRITICAL, "The model differs across ranks{on}",
        "DistributedDataParallel checks at construction that every rank has the same parameters (count, shapes); "
        "these ranks built another model.",
        "Build the model the same way on every rank (same config, same code path; no rank-dependent layers), and "
        "load checkpoints before wrapping in DDP on every rank."),
}

SIGNAL_CRASH = CauseText(
    "RUN002", Severity.CRITICAL, "{where} was killed ({signal})",
    "The process ended by a signal, with no Python error of its own. SIGKILL with no error is most often the "
    "kernel's out-of-memory killer; SIGSEGV or SIGABRT a crash in native code.",
    "Check `dmesg | grep -i -E 'oom|killed process'` on that host; if memory is short, run fewer ranks per node, "
    "fewer DataLoader workers or a smaller batch.")

EXIT_CRASH = CauseText(
    "RUN002", Severity.CRITICAL, "{where} exited with code {exitcode}",
    "The process ended with an error exit code, but its log holds no Python error: the error went to another "
    "file (torchrun --log-dir, --redirects) or the program exited on purpose.",
    "Read that rank's own output (torchrun's --log-dir, or the elastic error_file) for the reason.")

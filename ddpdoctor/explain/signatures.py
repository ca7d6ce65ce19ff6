"""The error messages of torch.distributed, NCCL, gloo, the elastic agent, Slurm, CUDA and
the DataLoader, as those libraries print them, each with what it tells about its rank.

`role` is what the first-cause rule needs: a `cause` is something that went wrong on the
rank that printed it (an exception, a kill, an OOM); a `wait` is a rank failing because a
peer did not come (timeouts, a closed connection); `context` adds evidence (interfaces,
exit codes, progress counters) and is never a failure by itself.

Every pattern here matches a message from tests/fixtures/explain/ (recorded on CPU ranks,
or quoted from the libraries' sources and public issues, see the README there).
`triggers` are plain substrings: one pass of a combined search finds candidate lines in
a 100 MB log before any per-line regex runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

CAUSE, WAIT, CONTEXT = "cause", "wait", "context"
_FIELD = re.compile(r"(?P<open> ?\(?)\{(?P<name>\w+)\}(?P<close>\)?)")


@dataclass(frozen=True)
class Signature:
    id: str
    role: str
    triggers: tuple[str, ...]
    pattern: "re.Pattern[str]"
    label: str  # a short name for tables; {field} from the pattern's groups
    source: str = ""  # the library that prints it
    flags: frozenset[str] = field(default_factory=frozenset)

    def describe(self, fields: dict[str, Any]) -> str:
        """The label with its fields; a field the line did not have drops out with its brackets."""
        def fill(m: "re.Match[str]") -> str:
            value = fields.get(m.group("name"))
            if value in (None, ""):
                return ""
            return f"{m.group('open')}{value}{m.group('close')}"

        return _FIELD.sub(fill, self.label)


def _sig(id: str, role: str, triggers: tuple[str, ...], pattern: str, label: str, source: str,
         *flags: str) -> Signature:
    return Signature(id, role, triggers, re.compile(pattern), label, source, frozenset(flags))


# Order matters: the first signature that matches a line names it (specific before generic).
SIGNATURES: tuple[Signature, ...] = (
    # -- collectives: desync, timeouts, peers gone ----------------------------------------
    _sig("detail_mismatch", CAUSE, ("Detected mismatch between collectives",),
         r"Detected mismatch between collectives on ranks\. Rank (?P<rank_a>\d+) is running collective: "
         r"(?P<fp_a>CollectiveFingerPrint\(.*?\)\)?)(?:, but | but )Rank (?P<rank_b>\d+) is running collective: "
         r"(?P<fp_b>CollectiveFingerPrint\(.*\))",
         "collectives differ (TORCH_DISTRIBUTED_DEBUG=DETAIL)", "torch.distributed"),
    _sig("nccl_watchdog_timeout", WAIT, ("Watchdog caught collective operation timeout",),
         r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
         r"(?:, NumelIn=(?P<numel_in>\d+))?(?:, NumelOut=(?P<numel_out>\d+))?.*?Timeout\(ms\)=(?P<timeout_ms>\d+)\)"
         r"(?: ran for (?P<ran_ms>\d+) milliseconds)?",
         "NCCL watchdog timeout in {op} #{seq}", "ProcessGroupNCCL"),
    # Three wordings over torch releases (about 2.3, 2.4-2.5, 2.6+) of one fact: where this rank is.
    _sig("nccl_work_progress", CONTEXT, ("Timeout at NCCL work", "detected by watchdog at work",
                                         "failure detected by watchdog at work sequence id"),
         r"(?:Timeout at NCCL work|detected by watchdog at work|watchdog at work sequence id): (?P<seq>-?\d+)"
         r"(?:,| PG status:) last enqueued (?:NCCL )?work: (?P<enqueued>-?\d+), last completed (?:NCCL )?work: "
         r"(?P<completed>-?\d+)",
         "NCCL progress: timed out at #{seq}, enqueued {enqueued}, completed {completed}", "ProcessGroupNCCL"),
    _sig("nccl_dump_signal", CONTEXT, ("Received a dump signal",),
         r"Received a dump signal (?:due to a collective timeout )?from\s+rank (?P<from_rank>\d+).*?"
         r"Last enqueued NCCL work: (?P<enqueued>-?\d+), last completed NCCL work: (?P<completed>-?\d+)",
         "asked to dump by rank {from_rank}: last enqueued #{enqueued}", "ProcessGroupNCCL"),
    _sig("nccl_heartbeat_stuck", CAUSE, ("watchdog got stuck for", "Heartbeat monitor timed out"),
         r"(?:watchdog got stuck for (?P<seconds>\d+) seconds|Heartbeat monitor timed out)",
         "NCCL watchdog thread stuck", "ProcessGroupNCCL"),
    _sig("gloo_size_mismatch", CAUSE, ("Received data size doesn't match expected size",),
         r"(?P<got>\d+) vs (?P<expected>\d+)\. Received data size doesn't match expected size",
         "gloo: received {got} bytes where {expected} were expected (collective mismatch)", "gloo"),
    _sig("gloo_timeout", WAIT, ("ms for recv operation", "ms for send operation", "Timed out waiting"),
         r"Timed out waiting (?P<timeout_ms>\d+)ms for (?P<what>recv|send) operation to complete",
         "gloo timeout waiting for a peer ({what})", "gloo"),
    # A rank waited for NCCL's id, which the group's rank R publishes in the store at its first collective, and
    # it never came (a timeout, not a lost connection): rank R never got there. torch 1.12-2.0 spell it
    # "retreiving" and say `Socket Timeout` or `Timeout waiting for key`; 2.4+ `wait timeout after Nms, keys: K`.
    _sig("ncclid_timeout", CAUSE, ("via c10d key-value store",),
         r"retr(?:ie|ei)ving ncclUniqueId from \[(?P<missing>\d+)\] via c10d key-value store by key '(?P<key>[^']*)', "
         r"but store->get\('[^']*'\) got error: (?P<err>(?:wait timeout after|Socket Timeout|Timeout waiting for key)"
         r"[^\n]*?)\.?$",
         "waited for NCCL's id from rank {missing}, which never came", "ProcessGroupNCCL"),
    # torch >= 2.1: a rank fetching NCCL's id from rank 0 through the store lost the store.
    _sig("store_get_error", CAUSE, ("via c10d key-value store",),
         r"retr(?:ie|ei)ving ncclUniqueId from \[(?P<from_rank>\d+)\] via c10d key-value store by key '(?P<key>[^']*)', "
         r"but store->get\('[^']*'\) got error: (?P<err>[^.]+)",
         "lost the store while fetching NCCL's id from rank {from_rank}: {err}", "ProcessGroupNCCL"),
    _sig("gloo_peer_closed", WAIT, ("Connection closed by peer", "Connection reset by peer"),
         r"(?:Connection closed by peer|Connection reset by peer)(?: \[(?P<peer>[^\]]+)\](?::(?P<port>\d+))?)?",
         "connection closed by peer ({peer})", "gloo"),
    # Horovod stops every rank once one rank raised or finished early: the ranks still in a collective say this.
    _sig("horovod_shutdown", WAIT, ("Horovod has been shut down",),
         r"Horovod has been shut down\. This was caused by an exception on one of the ranks",
         "Horovod shut down: another rank raised or finished", "Horovod"),
    _sig("store_broken", WAIT, ("Failed to recv, got 0 bytes", "Connection was likely closed"),
         r"(?:Failed to recv, got 0 bytes|Connection was likely closed)",
         "lost the connection to the rendezvous store", "c10d TCPStore"),
    # -- GPUs --------------------------------------------------------------------------------
    _sig("duplicate_gpu", CAUSE, ("Duplicate GPU detected",),
         r"Duplicate GPU detected ?: rank (?P<rank_a>\d+) and rank (?P<rank_b>\d+) both on CUDA device (?P<busid>\w+)",
         "two ranks on one GPU (bus id {busid})", "NCCL"),
    _sig("same_gpu_partition", CAUSE, ("Multiple Ranks are using the same GPU",),
         r"Multiple Ranks are using the same GPU", "two ranks on one GPU", "NCCL"),
    _sig("cuda_oom", CAUSE, ("CUDA out of memory",),
         r"CUDA out of memory\. Tried to allocate (?P<tried>[\d.]+ ?[KMGT]?i?B)"
         r"(?:.*?GPU (?P<gpu>\d+)(?: has a total capacity of|;) (?P<total>[\d.]+ ?[KMGT]?i?B))?"
         r"(?:.*?of which (?P<free>[\d.]+ ?[KMGT]?i?B) is free)?",
         "CUDA out of memory (tried to allocate {tried})", "torch CUDA allocator"),
    _sig("invalid_device_ordinal", CAUSE, ("invalid device ordinal",),
         r"invalid device ordinal", "CUDA: invalid device ordinal", "CUDA"),
    # One cause in every wording it has had: torch's check (1.x to today, a warning at CUDA init or the
    # error), and the CUDA runtime's own cudaErrorInsufficientDriver (35) as THCudaCheck, "cuda runtime error
    # (35)", "CUDA error: ...", NCCL's "Cuda failure '...'" and onnxruntime's "CUDA failure 35: ..." print it.
    _sig("driver_too_old", CAUSE, ("driver on your system is too old", "driver version is insufficient for CUDA runtime"),
         r"(?:NVIDIA driver on your system is too old(?: \(found version (?P<found>\d+)\))?"
         r"|CUDA driver version is insufficient for CUDA runtime version)",
         "NVIDIA driver too old for this CUDA", "torch / CUDA runtime"),
    # cudaErrorUnsupportedPtxVersion (222): the driver's JIT is older than the toolkit that wrote the PTX.
    _sig("ptx_toolchain", CAUSE, ("PTX was compiled with an unsupported toolchain",),
         r"PTX was compiled with an unsupported toolchain", "driver older than the toolkit of a kernel's PTX",
         "CUDA driver"),
    _sig("no_gpu", CAUSE, ("No CUDA GPUs are available", "CUDA driver initialization failed",
                           "Found no NVIDIA driver"),
         r"(?P<what>No CUDA GPUs are available|CUDA driver initialization failed|Found no NVIDIA driver)",
         "CUDA unusable: {what}", "torch"),
    # cudaErrorSystemDriverMismatch (803): the kernel module and the user-space driver library differ (a driver
    # updated without a reboot, a container's compat libcuda): torch's warning at CUDA init, or the error.
    _sig("driver_mismatch", CAUSE, ("unsupported display driver / cuda driver combination",),
         r"(?:Error 803: )?system has unsupported display driver / cuda driver combination",
         "NVIDIA kernel driver and CUDA driver library differ (error 803)", "CUDA driver"),
    # NCCL's own WARN naming the CUDA call that failed, printed below torch's generic `unhandled cuda error`.
    _sig("nccl_cuda_oom", CAUSE, ("Cuda failure",),
         r"Cuda failure(?: \d+)? 'out of memory'", "CUDA out of memory (NCCL's buffers)", "NCCL"),
    _sig("nccl_ipc_failure", CAUSE, ("failed to open CUDA IPC handle",),
         r"failed to open CUDA IPC handle ?: ?(?:\d+ )?(?P<what>.+)", "NCCL P2P: {what}", "NCCL"),
    _sig("nccl_cuda_failure", CAUSE, ("Cuda failure",),
         r"Cuda failure(?: \d+)? '(?P<what>[^']+)'", "NCCL: CUDA error {what}", "NCCL"),
    _sig("cuda_fatal", CAUSE, ("CUDA error: ",),
         r"CUDA error: (?P<what>[^.\n]+)", "CUDA error: {what}", "CUDA"),
    # torch <= 1.x (THC): `cuda runtime error (39) : uncorrectable ECC error encountered at FILE:LINE`.
    _sig("cuda_runtime_error", CAUSE, ("cuda runtime error (",),
         r"cuda runtime error \((?P<code>\d+)\) : (?P<what>.+?)(?: at \S+)?$", "CUDA error: {what}", "CUDA"),
    # torch's generic wrapper of a failed CUDA call inside NCCL (ncclUnhandledCudaError): the WARN above names it.
    _sig("nccl_unhandled_cuda", CAUSE, ("unhandled cuda error", "ncclUnhandledCudaError"),
         r"(?:unhandled cuda error|ncclUnhandledCudaError)", "NCCL: unhandled cuda error", "NCCL"),
    # -- NCCL transport ----------------------------------------------------------------------
    _sig("nccl_no_interface", CAUSE, ("no socket interface found", "No usable listening interface found"),
         r"(?P<what>[Nn]o socket interface found|No usable listening interface found)",
         "NCCL found no usable network interface", "NCCL"),
    _sig("nccl_socket_connect", CONTEXT, ("socketStartConnect", "Connect to"),
         r"NCCL WARN .*?Connect to (?P<addr>\S+?) failed ?: (?P<err>.*)",
         "NCCL could not connect to {addr}: {err}", "NCCL"),
    # `Net : Call to recv from ADDR failed : Broken pipe`, `socketProgressOpt: Call to recv from ...`: NCCL lost a peer
    # socket; weak (causes.py): a peer's own error, where the log has one, is the cause.
    _sig("nccl_socket_failed", CAUSE, ("Call to recv from", "Call to send to"),
         r"Call to (?:recv from|send to) (?P<addr>\S+?) failed ?: (?P<err>.+)",
         "NCCL socket to {addr}: {err}", "NCCL"),
    _sig("nccl_ib_verbs", CAUSE, ("Call to ibv_",),
         r"Call to (?P<call>ibv_\w+) failed(?: with error)? ?:? ?(?P<err>.+)",
         "InfiniBand verbs: {call} failed: {err}", "NCCL"),
    # NCCL <= 2.20 says `with error 12, opcode 0, len 0, vendor err 129`; later ones `with status=12 opcode=1 ...`.
    _sig("nccl_ib_error", CAUSE, ("Got completion from peer",),
         r"[Gg]ot completion from peer (?P<peer>\S+) with (?:status=|error )(?P<code>\d+)",
         "InfiniBand error {code}", "NCCL"),
    # The shared-memory transport's segment in /dev/shm (NCCL's `Last error:` under ncclSystemError): the node's.
    _sig("nccl_shm_error", CAUSE, ("Error while creating shared memory segment",),
         r"Error while creating shared memory segment (?P<segment>\S+)(?: \(size (?P<size>\d+)\))?",
         "NCCL could not create its shared-memory segment {segment}", "NCCL"),
    _sig("nccl_system_error", CAUSE, ("unhandled system error", "ncclSystemError"),
         r"(?:unhandled system error|ncclSystemError)(?:.*?NCCL version (?P<nccl_version>[\d.]+\S*))?",
         "NCCL unhandled system error", "NCCL"),
    # After the transport errors: torch prints NCCL's `Last error:` on the same line in some versions, and that
    # error (an InfiniBand completion, a socket) is the specific one.
    _sig("nccl_remote_error", WAIT, ("remote process exited or there was a network error", "ncclRemoteError"),
         r"(?:remote process exited or there was a network error|ncclRemoteError)",
         "NCCL: remote process exited or network error", "NCCL"),
    _sig("nccl_interface", CONTEXT, ("NCCL INFO NET/Socket", "NCCL INFO Bootstrap", "NCCL INFO NET/IB : Using"),
         r"NCCL INFO (?:NET/Socket|NET/IB|Bootstrap) ?: Using (?P<ifaces>.*)", "NCCL uses {ifaces}", "NCCL"),
    _sig("nccl_env_setting", CONTEXT, ("set by environment to",),
         r"(?P<var>NCCL_SOCKET_IFNAME|NCCL_IB_HCA|NCCL_IB_GID_INDEX|NCCL_NET|NCCL_IB_DISABLE|NCCL_P2P_DISABLE) "
         r"set by environment to (?P<value>\S+)", "{var}={value}", "NCCL"),
    _sig("nccl_comm_init", CONTEXT, (" nranks ",),
         r"NCCL INFO (?:ncclCommInitRank\w* )?comm \w+ rank (?P<rank>\d+) nranks (?P<nranks>\d+)"
         r"(?: cudaDev (?P<dev>\d+))?(?: nvmlDev \d+)?(?: busId (?P<busid>\w+))?",
         "NCCL communicator: rank {rank} of {nranks}", "NCCL"),
    _sig("elastic_world", CONTEXT, ("global_world_sizes=",),
         r"global_world_sizes=\[(?P<sizes>[\d, ]+)\]", "agent: world sizes {sizes}", "torch elastic"),
    _sig("clients_joined", CAUSE, ("clients joined",),
         r"Timed out after (?P<seconds>\d+) seconds waiting for clients\. (?P<joined>\d+)/(?P<expected>\d+) clients joined",
         "{joined} of {expected} ranks joined", "c10d TCPStore"),
    # torch 1.8-2.0's store-based barrier at the end of init_process_group (and new_group).
    _sig("store_barrier_timeout", CAUSE, ("in store based barrier on rank",),
         r"Timed out initializing process group in store based barrier on rank:? (?P<on_rank>\d+), for key: (?P<key>\S+) "
         r"\(world_size=(?P<expected>\d+), worker_count=(?P<joined>\d+)",
         "store-based barrier: {joined} of {expected} ranks", "torch.distributed"),
    # torch >= 2.4's store timeout names the keys; gloo's full mesh publishes one per rank (`.../cpu//0/2`), and
    # programs name theirs `rank_N`: the rank in the key never published it.
    _sig("store_key_rank_timeout", CAUSE, ("keys: ",),
         r"wait timeout after (?P<ms>\d+) ?ms, keys: (?P<key>\S*?(?:rank_|/cpu//\d+/)(?P<missing>\d+))$",
         "waited for rank {missing}'s store key {key}", "c10d TCPStore"),
    _sig("address_in_use", CAUSE, ("EADDRINUSE", "ddress already in use"),
         r"(?:port: (?P<port>\d+).*?)?(?:EADDRINUSE|[Aa]ddress already in use)",
         "port {port} already in use", "c10d TCPStore"),
    _sig("connect_timeout", CAUSE, ("while trying to connect to",),
         r"client socket has timed out after (?P<ms>\d+) ?ms while trying to connect to \((?P<addr>[^,]+), (?P<port>\d+)\)",
         "cannot reach the store at {addr}:{port}", "c10d TCPStore"),
    _sig("connect_failed", CONTEXT, ("has failed to connect to",),
         r"client socket has failed to connect to \[?(?P<addr>[^\]\s]+?)\]?:(?P<port>\d+) "
         r"\(errno: (?P<errno>\d+) - (?P<err>[^)]*)\)",
         "connect to {addr}:{port} failed: {err}", "c10d TCPStore"),
    # torch 1.x TCPStore: the MASTER_ADDR that does not resolve (a pod's service not up yet, a typo).
    _sig("store_host_unknown", CAUSE, ("Name or service not known", "Temporary failure in name resolution"),
         r"(?:host not found: )?(?P<err>Name or service not known|Temporary failure in name resolution)",
         "the store's host name does not resolve: {err}", "c10d TCPStore"),
    # Not matched by a line alone: `RuntimeError: Connection reset by peer` raised inside init_process_group
    # (scan.py reads the traceback above it); during training the same words are a peer's (gloo_peer_closed).
    _sig("store_reset_at_init", CAUSE, ("Connection reset by peer",),
         r"(?P<err>Connection reset by peer)", "the store reset the connection during init_process_group",
         "c10d TCPStore"),
    _sig("rdzv_timeout", CAUSE, ("RendezvousTimeoutError",),
         r"RendezvousTimeoutError(?::? ?(?P<msg>.*))?", "the elastic rendezvous timed out", "torch elastic"),
    _sig("rdzv_connection", CAUSE, ("RendezvousConnectionError", "connection to the C10d store has failed"),
         r"(?:RendezvousConnectionError|connection to the C10d store has failed)",
         "cannot reach the elastic rendezvous store", "torch elastic"),
    # -- processes: agent, Slurm, signals -----------------------------------------------------
    _sig("elastic_block", CONTEXT, ("(local_rank: ",),
         r"^\s*rank\s*: (?P<rank>\d+) \(local_rank: (?P<local_rank>\d+)\)",
         "torchrun: exited with {exitcode} ({signal})", "torch elastic"),
    _sig("elastic_failed", CONTEXT, ("failed (exitcode: ",),
         r"failed \(exitcode: (?P<exitcode>-?\d+)\) local_rank: (?P<local_rank>\d+) \(pid: (?P<pid>\d+)\)",
         "agent: local rank {local_rank} exited with {exitcode}", "torch elastic"),
    _sig("elastic_sigterm", CONTEXT, ("closing signal",),
         r"Sending process (?P<pid>\d+) closing signal (?P<signal>SIG\w+)",
         "agent stopped pid {pid} with {signal}", "torch elastic"),
    # -- other launchers' summaries of a worker's end (ddpdoctor/explain/launchers.py reads them) --
    _sig("launcher_signal", CAUSE, ("death signal", "got signal: ", "Main process received"),
         r"(?:Received (?:Signals\.)?(?P<signal>SIG\w+|\d+) death signal, shutting down workers|Process \d+ got signal: "
         r"(?P<signum>\d+)|Main process received (?P<signame>SIG\w+), exiting)",
         "the launcher received a signal and stopped its workers", "torch elastic, DeepSpeed"),
    _sig("deepspeed_exit", CONTEXT, ("exits with return code",),
         r"(?P<cmd>\[.*\]) exits with return code = (?P<exitcode>-?\d+)",
         "DeepSpeed launcher: a worker exited with {exitcode}", "DeepSpeed launcher"),
    _sig("called_process", CONTEXT, ("CalledProcessError: Command",),
         r"CalledProcessError: Command (?P<cmd>'.*?'|.*?) (?:returned non-zero exit status (?P<exitcode>-?\d+)|"
         r"died with <Signals\.(?P<signal>SIG\w+): \d+>)",
         "a launcher's worker process exited with {exitcode}{signal}", "torch.distributed.launch, accelerate"),
    _sig("mpi_signal", CONTEXT, ("noticed that process rank",),
         r"noticed that process rank (?P<rank>\d+) with PID (?P<mpi_pid>\S+) on node (?P<host>\S+?) exited on signal "
         r"(?P<signum>\d+)(?: \((?P<what>[^)]+)\))?",
         "mpirun: rank {rank} died of signal {signum}", "OpenMPI"),
    _sig("mpi_exit", CONTEXT, ("Process name: [[",),
         r"Process name: \[\[\d+,\d+\],(?P<rank>\d+)\]", "mpirun: rank {rank} exited with {exitcode}", "OpenMPI"),
    _sig("hydra_exit", CONTEXT, ("BAD TERMINATION",),
         r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
         "mpiexec: a process ended badly ({exitcode}{signal})", "MPICH / Intel MPI"),
    _sig("srun_task", CONTEXT, ("srun: error:",),
         r"srun: error: (?P<host>[\w.-]+): tasks? (?P<tasks>[\d,\- ]+): (?P<what>Killed|Out Of Memory|"
         r"Exited with exit code (?P<code>\d+)|Segmentation fault|Aborted|Terminated|Bus error)",
         "srun: task {tasks} on {host}: {what}", "Slurm"),
    _sig("slurm_oom", CAUSE, ("oom-kill event", "oom_kill event"),
         r"Detected (?P<count>\d+) oom[-_]kill event\(?s?\)? in (?:StepId=|step )?(?P<step>[\w.]+)",
         "Slurm: {count} out-of-memory kill(s)", "Slurm"),
    _sig("slurm_cancelled", CAUSE, ("CANCELLED AT",),
         r"(?:STEP|JOB) (?P<step>\S+) ON (?P<host>\S+) CANCELLED AT (?P<at>\S+)(?: DUE TO (?P<why>[A-Z_ ]+?))?(?:,| \*\*\*|$)",
         "Slurm cancelled the job ({why})", "Slurm"),
    # -- data loading, DDP -------------------------------------------------------------------
    _sig("dataloader_killed", CAUSE, ("is killed by signal",),
         r"DataLoader worker \(pid (?P<pid>\d+)\) is killed by signal: (?P<signal>[\w ]+)",
         "DataLoader worker killed by signal: {signal}", "torch DataLoader"),
    _sig("dataloader_shm", CAUSE, ("insufficient shared memory",),
         r"(?:Unexpected )?bus error encountered in worker\. This might be caused by insufficient shared memory",
         "DataLoader worker: out of shared memory (/dev/shm)", "torch DataLoader"),
    _sig("dataloader_exited", CAUSE, ("exited unexpectedly",),
         r"DataLoader worker \(pid\(s\) (?P<pids>[\d, ]+)\) exited unexpectedly", "DataLoader worker exited unexpectedly",
         "torch DataLoader"),
    _sig("dataloader_timeout", CAUSE, ("DataLoader timed out",),
         r"DataLoader timed out after (?P<seconds>\d+) seconds", "DataLoader timed out after {seconds} s", "torch DataLoader"),
    _sig("ddp_unused_params", CAUSE, ("finished reduction in the prior iteration",),
         r"Expected to have finished reduction in the prior iteration before starting a new one",
         "DDP: parameters without gradients (find_unused_parameters)", "torch DDP"),
    _sig("ddp_unused_names", CONTEXT, ("did not receive grad for rank",),
         r"Parameter(?:s| indices) which did not receive grad for rank (?P<rank>\d+): (?P<names>.*)",
         "DDP: parameters without grad on rank {rank}: {names}", "torch DDP"),
    _sig("ddp_model_mismatch", CAUSE, ("DDP expects same model across all ranks", "appears not to match"),
         r"(?:DDP expects same model across all ranks, but Rank (?P<rank_a>\d+) has (?P<n_a>\d+) params, "
         r"while rank (?P<rank_b>\d+) has inconsistent (?P<n_b>\d+) params|(?P<other>params\[\d+\] in this process with "
         r"sizes .*? appears not to match .*))",
         "DDP: the model differs across ranks", "torch DDP"),
    # -- generic: the last line of a Python traceback ----------------------------------------
    _sig("python_exception", CAUSE, ("Error", "Exception", "Interrupt"),
         r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*(?:Error|Exception|Interrupt)|Exception))(?:: ?(?P<msg>.*))?$",
         "{type}", "Python"),
)

BY_ID = {s.id: s for s in SIGNATURES}
# Exceptions that are a launcher's summary of a rank's failure, not a failure of their own.
REPORTING_EXCEPTIONS = ("ChildFailedError", "SignalException")


def trigger_words() -> tuple[str, ...]:
    """The fewest substrings that still find every trigger: a word containing another is dropped.

    The scanner runs one `str.find` pass per word (about 2 GB/s each); a regex alternation of
    all of them runs ten times slower, trying every alternative at every position.
    """
    words = sorted({t for s in SIGNATURES for t in s.triggers}, key=len)
    kept: list[str] = []
    for w in words:
        if not any(k in w for k in kept):
            kept.append(w)
    return tuple(kept)


def match_line(message: str) -> Optional[tuple[Signature, dict[str, Optional[str]]]]:
    for sig in SIGNATURES:
        if not any(t in message for t in sig.triggers):
            continue
        m = sig.pattern.search(message)
        if m:
            return sig, m.groupdict()
    return None

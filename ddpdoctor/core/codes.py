"""Every finding code ddpdoctor can emit, in one table: its severity, who emits it, where
docs/ explains it, and its why and fix where the code has one wording.

Users search for a code (the docs, a colleague's report, a CI log), so a code means one
thing wherever it is raised: `check`, `explain` and the callback take a shared code's words
from here instead of spelling them again. Titles stay at the call site: they carry the
ranks, hosts and numbers of the case. Where the words must differ per case (RUN009 seen by
DETAIL, by gloo, by NCCL's watchdog or in the Flight Recorder: each knows something the
others do not), the entry says so in `per_case` and leaves `why`/`fix` to the call site.

Pure data: imports only the core. tests/unit/test_codes_catalogue.py holds it to the code
(every code built anywhere is here, with a severity allowed here) and to docs/ (every code
has its section on the page named here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from ddpdoctor.core.findings import Finding, Severity

# The page that explains each family's codes: a heading or a table row names the code.
DOC_PAGES: Mapping[str, str] = {
    "allreduce": "docs/probes/allreduce.md",
    "callback": "docs/callback.md",
    "ddp-smoke": "docs/probes/ddp-smoke.md",
    "explain": "docs/explain.md",
    "gpu-count": "docs/probes/gpu-count.md",
    "homogeneity": "docs/probes/homogeneity.md",
    "history": "docs/fleet.md",
    "ingest": "docs/snapshots.md",
    "init-hang": "docs/probes/init-hang.md",
    "limits": "docs/probes/limits.md",
    "run": "docs/runtime.md",
    "scaling": "docs/scaling.md",
    "stragglers": "docs/probes/stragglers.md",
    "topology": "docs/probes/topology.md",
    "watch": "docs/callback.md",
}


@dataclass(frozen=True)
class Code:
    """One finding code. `severities` holds more than one where the same fault weighs more or
    less by what was measured (`severity_rule` says which when); `reserved`, if set, says why a
    code nothing emits yet keeps its place."""

    code: str
    severities: frozenset[Severity]
    family: str  # the probe or component that raises it
    doc: str  # the docs/ page with its section
    why: str = ""
    fix: str = ""
    severity_rule: str = ""
    per_case: str = ""
    reserved: str = ""

    @property
    def severity(self) -> Severity:
        """The code's one severity; a code with several has its call site choose (severity_rule)."""
        if len(self.severities) != 1:
            raise ValueError(f"{self.code} has several severities: {self.severity_rule}")
        return next(iter(self.severities))

    def allowed(self, severity: Optional[Severity]) -> Severity:
        """The severity a call site raises this code with: the code's own, or the one the case chose
        where the code has several (it must be one of them)."""
        if severity is None:
            return self.severity
        if severity not in self.severities:
            raise ValueError(f"{self.code} is never {severity.label}: {sorted(s.label for s in self.severities)}")
        return severity


def _code(code: str, severity: Union[Severity, frozenset[Severity]], family: str, **texts: str) -> Code:
    severities = severity if isinstance(severity, frozenset) else frozenset({severity})
    return Code(code, severities, family, DOC_PAGES[family], **texts)


_OK, _INFO, _WARN, _CRITICAL = Severity.OK, Severity.INFO, Severity.WARN, Severity.CRITICAL

_ENTRIES = (
    _code("INP001", _INFO, "ingest",
          why=("`ddpdoctor diagnose` read these files as other tools' outputs and judged the facts they hold with "
               "the probes' own diagnosis; what such an output cannot show (measured speed, the software stack, "
               "the links another command reports) is judged as unknown, never guessed."),
          fix=("For the full picture, run `ddpdoctor snapshot` (or `ddpdoctor check`) on the node itself, or add "
               "the outputs that show the rest (nvidia-smi -q -x, topo -m, nvlink --status, nccl-tests).")),
    _code("BW000", frozenset({Severity.INFO, Severity.OK}), "allreduce",
          severity_rule='INFO when another finding of the run explains a slow or failed measurement, else OK'),
    _code("BW001", _CRITICAL, "allreduce",
          why=('Every rank knows what each peer contributed, so the result is checked exactly; wrong elements mean '
               'corrupted data on the path to that rank (GPU memory, PCIe/NVLink, NIC, or a library bug), the kind of '
               'fault that shows up as a loss that suddenly diverges.'),
          fix=('Drain the node of the named ranks and run `dcgmi diag -r 3` and nccl-tests with `-c 1`; check '
               '`nvidia-smi -q -d ECC,ROW_REMAPPER` and the kernel log for Xid errors; try NCCL_PROTO=Simple to rule '
               'out a protocol bug; replace hardware that keeps failing.')),
    _code("BW002", _CRITICAL, "allreduce",
          why='--min-busbw makes this a gate: the interconnect did not deliver the bandwidth the job needs.',
          fix=('Look at the slow-link findings and the per-node view; check NCCL_DEBUG=INFO output for the transport '
               '("via NET/Socket" where "NET/IB" was expected, "via SHM" where "P2P/IPC" or NVLink was expected) and '
               'the links themselves (`nvidia-smi topo -m`, `ibstat`).')),
    _code("BW003", _WARN, "allreduce",
          why=('Each neighbouring pair of ranks ran its own all-reduce (judged by its best iteration); a rank whose '
               'two ring pairs are both slow has a slow link of its own (NIC, PCIe slot, NVLink), a single slow pair '
               'is the link between them.'),
          fix=('On the named node: `nvidia-smi topo -m` and `nvidia-smi nvlink -s` for NVLink, `lspci -vv` for the '
               "PCIe link (LnkSta vs LnkCap), `ibstat` / `ethtool` for the NIC's rate; then nccl-tests between just "
               'those ranks to confirm.')),
    _code("BW004", _WARN, "allreduce",
          why=("All nodes' ranks ran an all-reduce among themselves at once; this node's GPUs talk to each other "
               "slower than the others' do (NVLink down, a PCIe switch or slot trained low, P2P disabled)."),
          fix=('On that node: `nvidia-smi topo -m`, `nvidia-smi nvlink -s`, `lspci -vv` (LnkSta vs LnkCap); compare '
               'with a good node, and drain it if it differs.')),
    _code("BW005", _WARN, "allreduce",
          why=("Node pairs were timed in two rounds (the rank ring's pairs across nodes and the node leaders') and "
               'held against the fastest node pair and, where known, the rate their NICs declare; a node whose every '
               'pair is slow has a slow NIC, cable or port, a single slow pair is the path between those two nodes '
               '(with two nodes, one pair cannot tell which end).'),
          fix=("On the named node: the NIC's negotiated link speed and errors (`ethtool IFACE`, `ethtool -S`, `ibstat`,"
               ' `ibdiagnet`), the cable and switch port, and the interface NCCL/gloo chose (NCCL_SOCKET_IFNAME, '
               'GLOO_SOCKET_IFNAME; NCCL_DEBUG=INFO: "NET/IB" not "NET/Socket"); compare with a good node.')),
    _code("BW006", _WARN, "allreduce",
          why=('The expectation is the slowest hop of the ring the GPUs form (NVLink, PCIe, the socket link or the '
               "NIC) times NCCL's usual efficiency; falling to half of it on sizes large enough to be bandwidth-bound "
               'means the data takes a slower path than the links offer: NCCL over sockets instead of InfiniBand, '
               'through host memory instead of P2P, or a link running below its rate.'),
          fix=('Run with NCCL_DEBUG=INFO and read the transport of each channel ("via NET/Socket" where "NET/IB" was '
               'meant, "via SHM" where "P2P/IPC" or NVLink was meant); check that NCCL_P2P_DISABLE, NCCL_SHM_DISABLE '
               'and NCCL_IB_DISABLE are unset, and the topology findings (TOP001 PCIe below its rate, TOP002 NVLinks '
               'down, TOP004 P2P blocked by ACS/IOMMU).')),
    _code("BW007", _INFO, "allreduce",
          why=("nccl-tests' busbw assumes every byte crosses the ring's links 2(n-1)/n times; with in-network "
               'reduction (NVLink SHARP on NVSwitch systems, CollNet/SHARP on InfiniBand switches) the switch adds the'
               ' data, so less crosses the links and busbw can exceed their speed.'),
          fix=("Nothing to fix. Compare busbw with NCCL_NVLS_ENABLE=0 (and NCCL_COLLNET_ENABLE=0) to see the links' "
               'own figure; NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING shows the algorithm NCCL chose.')),
    _code("BW008", _INFO, "allreduce",
          why=("An all-reduce on one rank moves nothing between GPUs or processes: its time is the local "
               "reduction (a copy in place), so its algbw is a memory copy's figure (209,715 GB/s on an H100 at "
               "256 MiB) and busbw, nccl-tests' 2(n-1)/n link share, is 0 by definition. Neither says anything "
               "of a link."),
          fix=("Measure with 2 ranks or more: one per GPU (`ddpdoctor allreduce-bench` takes them all), across "
               "nodes with torchrun or srun. Several ranks on one GPU need NCCL 2.30 or newer with "
               "NCCL_MULTI_RANK_GPU_ENABLE=1, and then measure NCCL's own path, not a link.")),
    _code("BW009", _WARN, "allreduce",
          why=("With fewer GPUs than ranks and no backend asked for, the ranks ran on CPU with gloo: the figures "
               "are gloo's over the host's loopback, not the GPUs' or their links'. NCCL needs one GPU per rank "
               "(\"Duplicate GPU detected\" otherwise) before 2.30."),
          fix=("Run one rank per GPU (`--nproc` at most the GPU count; 2 or more to measure a link), on several "
               "nodes with torchrun or srun for more; `--backend gloo` when CPU figures are what you want.")),
    _code("DDP001", _OK, "ddp-smoke"),
    _code("DDP002", _CRITICAL, "ddp-smoke",
          why=('DDP keeps replicas identical only if every rank applies the same averaged gradient to the same '
               'starting weights; these ranks changed their weights outside DDP or skipped gradient synchronisation.'),
          fix=('Look for code that touches parameters on some ranks only (rank-dependent init after wrapping, loading '
               'a checkpoint on rank 0 after DDP construction, no_sync() left on) and keep it before the '
               'DistributedDataParallel(...) call.')),
    _code("DDP003", _CRITICAL, "ddp-smoke",
          why="DDP's gradient hook did not run, so these ranks trained on their local gradients only.",
          fix=("Make sure the model is wrapped in DistributedDataParallel and backward() runs on the wrapped model's "
               'output.')),
    _code("DDP004", _CRITICAL, "ddp-smoke",
          why=('A NaN or infinite loss on a synthetic, well-conditioned problem means broken arithmetic on that '
               'device.'),
          fix="Run the device's own diagnostics (e.g. `dcgmi diag -r 2`) and check for ECC errors on that GPU."),
    _code("DDP005", _CRITICAL, "ddp-smoke",
          why='These ranks delivered no result from the DDP workload; the run findings say what happened to them.',
          fix='Fix the crash, hang or error reported for these ranks first, then run the check again.'),
    _code("DOC001", _CRITICAL, "callback",
          why=('Without a DistributedSampler each rank iterates the whole dataset in the same order, so N ranks do the'
               ' work of one: the same gradients N times, N times the compute for nothing.'),
          fix=('Give the DataLoader sampler=DistributedSampler(dataset) (shuffle=False on the DataLoader) and call '
               'sampler.set_epoch(epoch) at the start of every epoch.')),
    _code("DOC002", _CRITICAL, "callback",
          why=("The ranks with fewer batches leave the loop while the others enter another step's gradient all-reduce,"
               " which then waits forever (or until the NCCL watchdog's timeout)."),
          fix=('Shard with DistributedSampler (it pads every rank to the same count) and drop_last=True. (model.join()'
               " for uneven inputs does not cover the ddpdoctor callback's own gather: balance the data.)")),
    _code("DOC003", _WARN, "callback",
          why=('DistributedSampler shuffles with seed + epoch; without set_epoch the epoch stays 0 and every epoch '
               "repeats the first one's order, which hurts convergence."),
          fix='Call loader.sampler.set_epoch(epoch) at the start of every epoch, before iterating the loader.'),
    _code("DOC004", _CRITICAL, "callback",
          why='Without DDP, gradients are never averaged: each rank trains its own model.',
          fix=('model = DistributedDataParallel(model, device_ids=[local_rank]) after init_process_group and '
               '.to(device).')),
    _code("DOC005", _WARN, "callback",
          why='The job was started as one process; DDP needs one process per GPU.'),
    _code("DOC006", _WARN, "callback",
          why='Steadily growing memory is usually a tensor kept across steps (a loss history kept with its graph).',
          fix='Store loss.item() (or detach()) instead of the loss tensor; look for lists that grow every step.'),
    _code("DOC007", _CRITICAL, "callback",
          why=('A rank waiting in a collective waits for a peer that never arrives: the named rank is that peer. It '
               'was stuck in its own code (data, I/O, a lock), dead, frozen, gone from the loop (uneven data), or in '
               "another collective than the others (a desync); the ranks in affected_ranks only waited for it."),
          fix=("Go to the named rank's line in your code (user_frame_by_rank, its python_stack): a lock, I/O or a "
               "data loader that blocks; for a dead rank its own output and `dmesg` (out of memory); for uneven data "
               "DistributedSampler(drop_last=True) or the Join context; for a desync the same collectives, in the "
               "same order with the same shapes, on every rank.")),
    _code("DOC008", _INFO, "callback",
          why=('Each rank iterates the whole dataset unless the sampler shards it; DOC001 says so for sure when the '
               "ranks' batches turn out identical."),
          fix='sampler=DistributedSampler(dataset), and sampler.set_epoch(epoch) every epoch.'),
    _code("DOC009", frozenset({Severity.WARN, Severity.INFO}), "callback",
          severity_rule='WARN when the process holds contexts on several GPUs, INFO for one',
          fix=('Replace nn.DataParallel(model) with DistributedDataParallel: one process per GPU started by `torchrun '
               '--nproc_per_node=<GPUs> train.py`, init_process_group("nccl"), torch.cuda.set_device(LOCAL_RANK), '
               'DistributedDataParallel(model.to(LOCAL_RANK), device_ids=[LOCAL_RANK]), and a DistributedSampler for '
               'the data. The per-process batch is then the old batch divided by the number of GPUs.')),
    _code("DOC010", _INFO, "callback",
          why=("Each optimizer step averages the gradients of every rank's batch, so the step is taken on the "
               "effective batch: N times one process's batch. A learning rate tuned on one GPU is then too small for "
               'the same number of epochs (linear rule, usual for SGD with a warm-up) or scales with the square root '
               '(usual for Adam-like optimizers).'),
          fix=("Information only. If the learning rate was tuned for one process's batch, scale it by one of the rules"
               ' (with a few epochs of warm-up for large factors); if it was tuned for the effective batch, keep it. '
               'Pass batch_size= to Doctor when a step accumulates several batches.')),
    _code("DOC011", _INFO, "callback",
          why=('A synchronous step takes as long on every rank as on the slowest: only the time each rank waits for '
               "the others tells the slow one from the waiting ones. ddpdoctor reads that wait from DDP's own reducer "
               "timings; FSDP's collectives are not timed there (nor is DDP's with measure_comm=False), so a rank slow "
               'to compute cannot be named here. A rank slow to load data still is (STR001, cause data loading).'),
          fix=('Run `ddpdoctor check --probes stragglers` on the same nodes for a compute verdict, or measure with a '
               'DDP-wrapped copy of the model.')),
    _code("DOC012", _WARN, "callback",
          why=("DDP averages the gradients of the parameters of the module it wraps, and only of those it found "
               "requiring a gradient when it was built. A tensor the optimizer also steps (a learnable temperature "
               "made with torch.ones(1, requires_grad=True), a loss module's nn.Parameter, a parameter frozen when DDP "
               "was built, a module replaced after wrapping) gets each rank's own gradient: every rank trains its own "
               "copy, and the checkpoint keeps rank 0's."),
          fix=("Register it as an nn.Parameter of the module DDP wraps before DDP(...) (or wrap the loss module in "
               "DDP too), build DDP after freezing and unfreezing is settled, or all-reduce its gradient yourself "
               "before optimizer.step().")),
    _code("DOC013", frozenset({Severity.WARN, Severity.CRITICAL}), "callback",
          severity_rule=("CRITICAL when the norms of a differing tensor are a millionth or more apart (or non-finite), "
                         "WARN when they differ in the last bits only"),
          per_case="the cause and its fix are read from the numbers: see docs/callback.md, 'Ranks out of sync'"),
    _code("DOC014", _CRITICAL, "callback",
          why=("DDP keeps replicas identical only if every rank applies the averaged gradient with the same "
               "optimizer settings; a learning rate computed from rank-local progress, a scheduler stepped on one "
               "rank or fed a rank-local loss (ReduceLROnPlateau), or different parameter groups make the weights "
               "drift apart at the next step."),
          fix=("Compute learning rates and schedules from values that are the same on every rank (all-reduce a "
               "validation loss before ReduceLROnPlateau, step schedulers on every rank), and build the same "
               "parameter groups everywhere.")),
    _code("DOC015", _CRITICAL, "callback",
          why=("DDP averages gradients only for a backward that follows a forward through the DDP model itself with "
               "gradient sync on (its forward arms the reducer). A loss computed with model.module(...) or a helper "
               "method of the inner module, or gradient accumulation that keeps even the last micro-batch under "
               "no_sync(), trains every rank on its own batch alone."),
          fix=("Call the DDP-wrapped model in the training step (ddp_model(x), not ddp_model.module(x)), and run the "
               "last micro-batch of each accumulation outside no_sync().")),
    _code("DOC016", _INFO, "callback",
          why=("With broadcast_buffers=False (forward_sync_buffers=False) DDP does not copy rank 0's buffers to the "
               "other ranks: BatchNorm's running mean and variance are each rank's own, by design; a checkpoint "
               "saved by rank 0 keeps rank 0's statistics, and evaluation on other ranks uses theirs."),
          fix=("Information. For statistics over the whole batch use SyncBatchNorm (convert_sync_batchnorm); to "
               "evaluate with one set of statistics, broadcast the buffers from rank 0 before evaluating.")),
    _code("DOC017", _CRITICAL, "callback",
          why=("A NaN or inf in one rank's weights while its peers' are finite: a step was skipped, or taken, on "
               "some ranks only (an `if torch.isfinite(loss)` decided per rank), after which the replicas differ "
               "for good."),
          fix=("Make skip decisions on every rank alike (all-reduce the non-finite flag before acting on it), and "
               "find where the NaN comes from (a learning rate too high, an fp16 overflow, a bad batch).")),
    _code("DOC018", _WARN, "callback",
          why=("A NaN or inf loss on one rank becomes a NaN gradient on every rank at the next all-reduce (DDP "
               "averages it in): the weights then go non-finite everywhere alike (or, under a GradScaler, the step "
               "is skipped everywhere) and nothing else says where it began. The loss is each rank's own: the rank "
               "first non-finite is where to look; ranks non-finite at the same step share the cause."),
          fix=("On the rank named first, look at that step's batch (a corrupt sample, a division by a zero count, a "
               "log of 0), its device, and its inputs' range; where every rank went together, lower the learning "
               "rate, clip gradients, or train in bfloat16 instead of float16. `torch.autograd.detect_anomaly()` "
               "on that rank names the operation that made the first NaN.")),
    _code("DOC019", _WARN, "callback",
          why=("DDP copies rank 0's buffers to every rank at the start of each forward (broadcast_buffers=True), "
               "so just after that copy every buffer it broadcasts is the same on every rank. A buffer that differs "
               "there is one DDP does not broadcast: on a model that had no buffer when DDP(...) was built DDP "
               "broadcasts none, even one registered later (torch reads the list again only when it broadcasts); "
               "buffers DDP was told to ignore are not broadcast either. Each rank keeps its own statistic, "
               "evaluation differs by rank, and a checkpoint saved by rank 0 keeps rank 0's."),
          fix=("Register buffers before wrapping the model in DDP(...) (or give the model any buffer at "
               "construction), or broadcast them from rank 0 yourself (torch.distributed.broadcast) after "
               "changing them; all-reduce a statistic that should cover every rank's data.")),
    _code("DOC020", _INFO, "callback",
          why=("The Hugging Face Trainer passes its callbacks no loss, and `ddpdoctor run` attaches to a script it "
               "cannot edit; both read the loss the model returns (outputs.loss, or a model whose forward returns "
               "it) off the model's forward. A loss computed outside the model (compute_loss_func, label smoothing, "
               "a plain loop's loss_fn(model(x), y)) never passes there, so which rank's loss went NaN first cannot "
               "be said, and the Trainer's logging_nan_inf_filter (on by default) hides a NaN loss from its logs."),
          fix=("Let the model compute the loss (pass labels), or give Doctor the loss in a loop you edit "
               "(`step.loss = loss`); set logging_nan_inf_filter=False to see non-finite losses in the logs.")),
    _code("DOC021", frozenset({Severity.WARN, Severity.CRITICAL}), "callback",
          severity_rule="CRITICAL when a missing rank's process is known gone or stopped, WARN when it only did not answer",
          why=("At the end of the run every rank sends its last window to rank 0 through the job's store; this rank's "
               "never came within the wait (a few seconds). Its process died (an out-of-memory kill, a crash after "
               "its last step), is stopped, is still busy in code its peers do not run, or cannot reach the store. "
               "The ranks that arrived ended normally; what the named rank did last is in its own output."),
          fix=("Look at the named rank's own log and exit status (torchrun prints each worker's), `dmesg` for an "
               "out-of-memory kill on its node, and whether it runs extra work after training (evaluation, a "
               "checkpoint) that the others do not: close the Doctor after that work on every rank.")),
    _code("GPU000", frozenset({Severity.OK, Severity.INFO}), "gpu-count",
          severity_rule='OK when every rank sees its GPU, INFO when the check ran without GPUs'),
    _code("GPU001", _CRITICAL, "gpu-count",
          why=('NCCL refuses two ranks on one GPU ("Duplicate GPU detected" / "Multiple Ranks are using the same '
               'GPU/Partition"); with gloo they compete for its memory and compute.')),
    _code("GPU002", _WARN, "gpu-count",
          why='Launched with fewer processes per node than GPUs (e.g. --nproc_per_node=2 on a 4-GPU node).'),
    _code("GPU003", _CRITICAL, "gpu-count",
          per_case=("gpu-count counts the ranks on each GPU; explain reads NCCL's refusal, worded one way before "
                    "NCCL 2.30 (Duplicate GPU detected) and another after (Multiple Ranks are using the same GPU)")),
    _code("GPU004", _CRITICAL, "gpu-count",
          why=('Each context costs several hundred MB on that GPU: the classic "OOM on GPU 0 only" when ranks touch '
               "cuda:0 (torch.cuda.set_device missing, tensors created with device='cuda' before it)."),
          fix=("Call torch.cuda.set_device(LOCAL_RANK) first thing, and use torch.device('cuda', LOCAL_RANK) "
               'explicitly.')),
    _code("GPU005", frozenset({Severity.CRITICAL, Severity.WARN}), "gpu-count",
          severity_rule=("CRITICAL when CUDA_VISIBLE_DEVICES or LOCAL_RANK leaves a rank without its GPU, WARN when "
                         "the variable is only partly readable"),
          per_case=("gpu-count names what hides the GPU (an unreadable, empty or wrong CUDA_VISIBLE_DEVICES, LOCAL_RANK "
                    "past the visible GPUs); explain reads CUDA's `invalid device ordinal`")),
    _code("GPU006", _WARN, "gpu-count",
          why=('What the scheduler allocated and what CUDA exposes disagree: GPUs are idle, or shared with another '
               'job.'),
          fix=('Request GPUs with --gres=gpu:N or --gpus-per-node and do not override CUDA_VISIBLE_DEVICES in the job '
               'script; if torch sees none, check it is a CUDA build.')),
    _code("GPU007", _WARN, "gpu-count",
          why='Another job or a leftover process shares these GPUs: less memory, slower steps, possible OOM.',
          fix=('Find them with `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`; end leftovers, or ask '
               'the scheduler for exclusive GPUs (--exclusive, or GPU exclusive-process compute mode).')),
    _code("GPU008", _CRITICAL, "gpu-count",
          per_case=("gpu-count words it from the rank's own CUDA error; explain tells a driver too old for torch "
                    "from no usable GPU at all, which need different fixes")),
    _code("GPU009", _WARN, "gpu-count",
          why='The classic "only one GPU is used": the script was started with `python train.py`, not torchrun.'),
    _code("HIS001", _WARN, "history",
          why=("Against the fleet's median of the same GPU (or CPU) model, this node measured slower from the named "
               'run on than it did before, for several runs in a row: a change in the node (thermal throttling, a '
               'power cap, a slower link, a failing fan or DIMM), not one unlucky run and not the whole fleet.'),
          fix=('Compare the node with a good one from that date on: `nvidia-smi -q -d CLOCK,PERFORMANCE,POWER,TEMPERATURE` '
               "(throttle reasons), `ddpdoctor check` on it alone, the admins' change log for that day; drain it if "
               'it stays slow.')),
    _code("HIS002", _CRITICAL, "history",
          why=("This node's share of runs with a critical finding is far above its peers' (a one-sided binomial test "
               'against the pooled rate of the other nodes, corrected for the number of nodes judged): a few such '
               'lemon nodes cause most failures of a fleet.'),
          fix=('Drain the node and run the vendor diagnostics (`dcgmi diag -r 3`, memory and NIC tests); read its '
               'critical findings over time (`ddpdoctor history --node NODE --json`) for the part that keeps failing.')),
    _code("HIS003", frozenset({Severity.CRITICAL, Severity.WARN}), "history",
          severity_rule=('CRITICAL when uncorrected ECC errors or failed row remaps keep rising, WARN when pending '
                         'remaps or retired pages do'),
          why=('The counter grew between several runs: the GPU keeps finding new faulty memory. Uncorrected errors '
               'crash or corrupt jobs; remapping has a fixed number of spare rows per bank.'),
          fix=('Drain the GPU and reset it (`nvidia-smi -r`) to apply pending remaps; `nvidia-smi -q -d '
               'ECC,ROW_REMAPPER,PAGE_RETIREMENT` shows the counts; a GPU whose counts keep rising after a reset, '
               'or with a remap failure, goes back to the vendor (RMA).')),
    _code("HOM000", _OK, "homogeneity"),
    _code("HOM001", _WARN, "homogeneity",
          why=('DDP waits for the slowest GPU at every step, and the smallest memory sets the batch size every rank '
               'can hold.'),
          fix=('Request identical GPUs (a Slurm constraint or node feature, e.g. --constraint=h100_80gb) or exclude '
               'the odd nodes (--exclude).')),
    _code("HOM002", _CRITICAL, "homogeneity",
          why=('Ranks running different torch or NCCL builds may disagree on the collective protocol: hangs, "NCCL '
               'error: invalid usage" or silently wrong results.'),
          fix=('Run every rank from the same environment: one container image or one shared venv/conda env, and check '
               "`python -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())'` on each node.")),
    _code("HOM003", _WARN, "homogeneity",
          why=('Nodes on different driver branches behave differently (NVLink, P2P, NCCL features) and an old driver '
               'can refuse a newer CUDA runtime.'),
          fix="Drain the odd nodes and bring them to the cluster's driver version, or exclude them from the job."),
    _code("HOM004", _INFO, "homogeneity",
          why="These differences do not change DDP's results; they can explain small speed gaps."),
    _code("HOM005", frozenset({Severity.WARN, Severity.INFO}), "homogeneity",
          severity_rule='WARN when ranks on one node disagree, INFO when only nodes differ'),
    _code("HOM006", _WARN, "homogeneity",
          why=('DDP runs every step at the pace of its slowest rank. On identical hardware a slower rank points at '
               'clocks held low, thermal or power throttling, another process on its device, or a busy CPU.')),
    _code("HOM007", frozenset({Severity.CRITICAL, Severity.WARN, Severity.INFO}), "homogeneity",
          severity_rule=('CRITICAL for a failed row remap, WARN for errors since the last reset or a pending remap, '
                         'INFO for lifetime counts'),
          why=('Uncorrectable ECC errors kill the process that hit them (Xid 48/63/64) and can corrupt results; a '
               'pending row remap only takes effect after a GPU reset, and a failed remap means the GPU has run out of'
               ' spare rows.'),
          fix=('Drain the node; reset the GPU (`nvidia-smi -r -i <id>` with no process on it, or reboot) to apply '
               'pending remaps; if remapping failed or errors return, replace the GPU (NVIDIA: RMA).')),
    _code("HOM008", frozenset({Severity.WARN, Severity.INFO}), "homogeneity",
          severity_rule='WARN when some GPUs are capped and others are not, INFO when every GPU given is capped',
          why='A GPU capped below its default power limit runs at lower clocks under load, and DDP waits for it.',
          fix='Restore it with `sudo nvidia-smi -i <id> -pl <default W>` (or ask the admins why it was capped).'),
    _code("HOM009", _WARN, "homogeneity",
          why='Application clocks were set below the default (`nvidia-smi -ac`), so this GPU computes slower.',
          fix='Reset them with `sudo nvidia-smi -i <id> -rac` (and `-rgc` if clocks were locked with -lgc).'),
    _code("HOM010", frozenset({Severity.WARN, Severity.INFO}), "homogeneity",
          severity_rule='WARN for hardware or thermal slowdown, INFO for the software power cap',
          why=('The driver lowered this GPU\'s clocks for heat, power or a hardware signal ("HW Slowdown", "Thermal '
               'Slowdown" in `nvidia-smi -q -d PERFORMANCE`).'),
          fix=("Check cooling and airflow (`nvidia-smi -q -d TEMPERATURE`), the PSU and power brake, and the BMC's "
               'logs; a GPU that keeps throttling on a cool node should be replaced.')),
    _code("HOM011", _WARN, "homogeneity",
          why=('DataLoader workers, pinned buffers, checkpoint saving and CPU offload all take host RAM per GPU; below'
               ' about 16 GiB per GPU jobs get OOM-killed (exit 137, "Killed") or swap.'),
          fix='Use fewer DataLoader workers per rank and smaller prefetch, or run on nodes with more memory per GPU.'),
    _code("HOM012", _WARN, "homogeneity",
          why=("Each rank's torch starts one thread per core; several ranks per node then fight over the cores and "
               'every CPU-side step (data loading, optimizer on CPU, gloo) slows down. torchrun sets OMP_NUM_THREADS=1'
               ' for this reason; srun and mp.spawn do not.'),
          fix='Export OMP_NUM_THREADS=<cores per node / ranks per node> in the job script (or use torchrun).'),
    _code("HOM013", _INFO, "homogeneity",
          why='More compute threads than cores: the ranks time-share, and their measured speeds are scheduling noise.',
          fix='Give each rank its own cores (fewer ranks per node, or OMP_NUM_THREADS=cores/ranks) to compare them.'),
    _code("HOM014", _INFO, "homogeneity",
          why=('Without persistence mode the driver tears down and re-initialises the GPU between jobs: seconds of '
               'extra start-up and re-trained links.'),
          fix='Run nvidia-persistenced (or `sudo nvidia-smi -pm 1`) on GPU nodes.'),
    _code("HOM015", _WARN, "homogeneity",
          why=('Processes that are not part of this job took that much CPU while the check ran (measured from each '
               "process's CPU time, ours left out). Data loading, gloo and the CPU side of every step slow down, so a "
               "straggler or a slow speed measured there may be the other job's doing, not the hardware's."),
          fix=('Find them with `top` or `ps -eo pid,pcpu,comm --sort=-pcpu | head`; ask the scheduler for whole nodes '
               '(Slurm --exclusive) or exclude the node, then check again.')),
    _code("HOM020", frozenset({Severity.CRITICAL, Severity.WARN}), "homogeneity",
          severity_rule='CRITICAL when a DCGM test failed on the GPU, WARN when it only warned',
          why=("DCGM's diagnostic (`dcgmi diag -r N`) loads the GPU (memory, PCIe, stress) and watches it; a failed "
               'test means the GPU misbehaved under load (overheating, memory errors, a link dropping, CUDA not '
               'starting), which an idle reading does not show: a job on it crashes, hangs or runs slow.'),
          fix=("Drain the node and act on DCGM's own text in the finding (cooling for thermal violations, a reset and "
               'a re-run for memory or CUDA errors); re-run `dcgmi diag -r 3` and replace the GPU (RMA) if it fails '
               'again.')),
    _code("HOM016", frozenset({Severity.WARN, Severity.INFO}), "homogeneity",
          severity_rule='WARN when MIG mode is on now, INFO when it comes on at the next GPU reset',
          why=('In MIG mode the GPU is split into instances with a fraction of its SMs and memory each: a rank gets a '
               'slice, not the GPU, and NCCL cannot run collectives between MIG instances of one GPU.'),
          fix=('For DDP on whole GPUs, disable it with no process on the GPU: `sudo nvidia-smi -i <id> -mig 0`, then '
               'reset the GPU (`nvidia-smi -r -i <id>`) or reboot; or give each rank a whole GPU elsewhere.')),
    _code("HOM017", frozenset({Severity.WARN, Severity.INFO}), "homogeneity",
          severity_rule=('WARN for a link narrower than its maximum, or a lower generation while the GPU works (P0-P2); '
                         'INFO for a narrow link read while the GPU idles'),
          why=('Host-to-GPU copies (data loading, pinned buffers) and NCCL traffic that crosses PCIe run at the link '
               "the GPU trained: x8 halves the bandwidth of x16, and each generation below the maximum halves it again."
               ' A GPU idling in P8 lowers its generation to save power, which is not a fault.'),
          fix=('Reseat the GPU or move it to a slot with all its lanes (check the riser and the BIOS bifurcation '
               'settings); read `nvidia-smi -q -d PCI` again under load; a link that keeps training down needs the '
               'vendor (cable, riser, board).')),
    _code("INIT000", _OK, "init-hang",
          why='Every rank resolved the rendezvous address, reached the store and initialised the process group.',
          fix='Nothing to do.'),
    _code("INIT001", frozenset({Severity.CRITICAL, Severity.WARN}), "init-hang",
          severity_rule="CRITICAL when this run's backend reads the variable, WARN when only another backend would"),
    _code("INIT002", frozenset({Severity.CRITICAL, Severity.INFO}), "init-hang",
          severity_rule='CRITICAL when gloo is the backend, INFO otherwise',
          why=('Without GLOO_SOCKET_IFNAME, gloo binds to the address its host name resolves to; a hosts-file line '
               'like `127.0.1.1 myhost` makes that loopback, which peers on other nodes cannot reach (gloo warns '
               '"Unable to resolve hostname to a (local) address. Using the loopback address as fallback", then '
               'connections time out).'),
          fix=('Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the cluster interface, e.g. the one the route to '
               "MASTER_ADDR uses, or fix /etc/hosts so the host name maps to that interface's address.")),
    _code("INIT003", _WARN, "init-hang",
          why=('The ranks met this time, but each node asks its own resolver (DNS, /etc/hosts); a node with a stale or'
               ' local entry for the name connects elsewhere, and the job hangs at init on the day it matters.'),
          fix="Use the rendezvous host's IP address as MASTER_ADDR, or make its name resolve the same on every node."),
    _code("INIT004", _WARN, "init-hang",
          why=('Every other rank waited idle for these; the usual causes are a slow start (imports from a busy network'
               ' filesystem, a container still pulling, a node busy with another job) or a launcher that started them '
               'late. A rendezvous timeout shorter than the gap fails the whole job.'),
          fix=("Look at `start_to_arrival_s`: a large value is this process's own start-up (pre-install or cache the "
               'environment on local disk); a small one means it was launched late (check the scheduler and the '
               'launcher on that node).')),
    _code("INIT005", frozenset({Severity.CRITICAL, Severity.WARN}), "init-hang",
          severity_rule=("CRITICAL when the process group's init did not finish on every rank, WARN when it did (the "
                         "backend found a way, another interface perhaps: NCCL's own connections come at its first "
                         "collective)"),
          why=("gloo and NCCL connect every rank to its peers on ports the system picks (above 1024, new each run); the "
               "rendezvous store's port is not enough. A firewall that passes only MASTER_PORT (firewalld or iptables on"
               " a node, a cloud security group, a Kubernetes NetworkPolicy) lets every rank arrive, then the process "
               "group's init or its first collective hangs until its timeout on every rank: \"Connection timed out\", "
               "gloo's \"Timed out waiting ... for recv operation\", NCCL's \"socketStartConnect: Connect to ... "
               "failed\" or \"Software caused connection abort\", \"No route to host\". Tried directly here: one TCP "
               "connection from each node's first rank to every other node's, on a port the system picked."),
          fix=("Allow all TCP between the job's nodes on the interface it uses: firewalld `firewall-cmd --permanent "
               "--zone=trusted --add-source=<cluster subnet>` then `--reload`; iptables `-A INPUT -s <cluster subnet> "
               "-j ACCEPT`; a cloud security group rule allowing all TCP from the group itself; a Kubernetes "
               "NetworkPolicy allowing pod-to-pod traffic. Check with `nc -zv <other node> <port>` on a port other "
               "than MASTER_PORT, from each node.")),
    _code("INIT006", frozenset({Severity.CRITICAL, Severity.WARN}), "init-hang",
          severity_rule=("CRITICAL when this run's backend reads the variable, except gloo's whose init finished on "
                         "every rank (it found a way this time: WARN; NCCL's init is lazy and says nothing); WARN when "
                         "only another backend reads it")),
    _code("LIM000", _OK, "limits",
          why=("Each rank's /dev/shm, open-file and process limits, its cgroup's memory and CPU quota, and (where an "
               "InfiniBand/RoCE device is present) its locked-memory limit leave room for what this job needs."),
          fix="Nothing to do."),
    _code("LIM001", frozenset({Severity.CRITICAL, Severity.WARN}), "limits",
          severity_rule=("CRITICAL below what NCCL's shared-memory transport (or a DataLoader the caller knows) needs, "
                         "WARN below what a usual DataLoader would need when the loader is not known"),
          why=("DataLoader workers hand every batch to their rank through /dev/shm, and NCCL's shared-memory "
               "transport and proxy put their buffers there; a full /dev/shm kills the workers with \"Bus error\" / "
               "\"ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared "
               "memory (shm)\", and NCCL with \"unable to extend /dev/shm\" or \"Error while creating shared memory "
               "segment\". A container's /dev/shm is its own tmpfs: Docker gives 64 MB unless told otherwise."),
          fix=("Give the ranks a larger /dev/shm: `docker run --shm-size=16g` (or `--ipc=host`); on Kubernetes mount "
               "an `emptyDir` with `medium: Memory` (and a `sizeLimit`) at /dev/shm; under Slurm ask the admins to "
               "size /dev/shm (or clean it in the prolog: stale files of killed jobs fill it) and request the "
               "memory with `--mem` (tmpfs pages count against the job's memory). Else lower num_workers, or "
               "NCCL_SHM_DISABLE=1 (slower: NCCL then goes through the network stack).")),
    _code("LIM002", frozenset({Severity.CRITICAL, Severity.WARN}), "limits",
          severity_rule=("CRITICAL below what the ranks, their peers and GPUs need, WARN below that plus a usual "
                         "DataLoader when the loader is not known"),
          why=("Every peer connection (gloo's pairs, NCCL's bootstrap and proxy sockets), every GPU (the /dev/nvidia* "
               "nodes, CUDA IPC handles) and every DataLoader worker (its pipes, and one descriptor per tensor in "
               "flight under torch's default file_descriptor sharing strategy) holds file descriptors. Past "
               "RLIMIT_NOFILE the next one fails with \"OSError: [Errno 24] Too many open files\" or "
               "\"RuntimeError: received 0 items of ancdata\", often deep inside a collective or a worker."),
          fix=("Raise the limit where the job starts: `ulimit -n 65536` in the job script (up to the hard limit; "
               "raising the hard limit needs root), `docker run --ulimit nofile=65536:65536`, on Kubernetes the "
               "container runtime's LimitNOFILE, under Slurm the limit of the shell you submit from (Slurm "
               "propagates it: PropagateResourceLimits) or the node's limits.conf. Or "
               "`torch.multiprocessing.set_sharing_strategy('file_system')` for the DataLoader's tensors.")),
    _code("LIM003", frozenset({Severity.CRITICAL, Severity.INFO}), "limits",
          severity_rule="CRITICAL when the node's ranks have GPUs (NCCL will use the RDMA device), INFO otherwise",
          why=("NCCL's InfiniBand/RoCE transport registers (pins) its buffers with the NIC, and each registration "
               "counts against RLIMIT_MEMLOCK; a limited value (often 64 KB, or 8 MB in containers) makes it fail "
               "with \"NET/IB : ibv_reg_mr failed: Cannot allocate memory\" (\"Call to ibv_reg_mr failed\"), or "
               "fall back to sockets, many times slower. NCCL's documentation asks for an unlimited memlock."),
          fix=("Make it unlimited where the job starts: `ulimit -l unlimited` in the job script (within the hard "
               "limit), `docker run --ulimit memlock=-1:-1`, on Kubernetes the runtime's LimitMEMLOCK=infinity (or "
               "IPC_LOCK), under Slurm `memlock unlimited` in the nodes' /etc/security/limits.conf and "
               "PropagateResourceLimitsExcept=MEMLOCK in slurm.conf.")),
    _code("LIM004", frozenset({Severity.CRITICAL, Severity.WARN}), "limits",
          severity_rule=("CRITICAL below what the ranks' threads will need, WARN below that plus a usual DataLoader "
                         "when the loader is not known"),
          why=("Every thread and process counts against the cgroup's pids.max (a container's --pids-limit, a pod's "
               "PID limit, a Slurm cgroup) and the user's RLIMIT_NPROC: torch's thread pools, NCCL's and gloo's "
               "threads and each DataLoader worker. Past it, the next one fails with \"Resource temporarily "
               "unavailable\" (EAGAIN), \"RuntimeError: can't start new thread\" or \"fork: retry: Resource "
               "temporarily unavailable\"."),
          fix=("Raise the limit: `docker run --pids-limit` (or -1), the pod's or kubelet's podPidsLimit, Slurm's "
               "cgroup TaskPids limits, `ulimit -u` in the job script for RLIMIT_NPROC; or run fewer DataLoader "
               "workers and fewer intra-op threads (OMP_NUM_THREADS) per rank.")),
    _code("LIM005", _WARN, "limits",
          why=("The cgroup's memory limit (a container's --memory, a pod's memory limit, Slurm's --mem) holds every "
               "rank, its DataLoader workers and the files in its tmpfs /dev/shm; past it the kernel's OOM killer "
               "kills one of them (\"Killed\", exit 137 / signal 9, \"DataLoader worker (pid N) is killed by signal: "
               "Killed\", \"oom-kill\" in dmesg), and the others hang or fail in their next collective."),
          fix=("Request more memory (`docker run --memory`, the pod's `resources.limits.memory`, Slurm's `--mem` or "
               "`--mem-per-gpu`), or run fewer ranks, workers or a smaller batch per node.")),
    _code("LIM006", _WARN, "limits",
          why=("A cgroup CPU quota below a core per rank (plus its DataLoader workers) throttles the ranks every "
               "period; DDP is synchronous, so the whole job runs at the pace of the most throttled rank.")),
    _code("LIM007", _WARN, "limits",
          why=("NCCL_IB_HCA chooses the RDMA devices NCCL's IB transport may use; when none it names is on the node "
               "NCCL says \"NET/IB : No device found.\" and falls back to sockets (\"NET/Socket\"), many times "
               "slower, or fails where NCCL_IB_DISABLE=0 is required by the job."),
          fix=("Set NCCL_IB_HCA to devices the node has (`ls /sys/class/infiniband`, `ibv_devinfo`; a prefix like "
               "mlx5 selects every mlx5_N), or unset it.")),
    _code("LIM008", _INFO, "limits", per_case="each variable has its own cost; the finding says which"),
    _code("LIM009", _INFO, "limits",
          why=("Checkpoints, logs, core dumps, torch.compile/Triton caches and the report itself are written there; "
               "a full disk fails the job late with \"OSError: [Errno 28] No space left on device\"."),
          fix="Free space there, or point TMPDIR (and the output folder) at a filesystem with room."),
    _code("LOG000", _INFO, "explain",
          why=('None of the error messages of torch.distributed, NCCL, gloo, the elastic agent, Slurm, CUDA or the '
               'DataLoader that ddpdoctor knows appears here: the job may have hung silently, or its errors went to '
               'another file.'),
          fix=('Run `ddpdoctor check` with the same launcher and ranks to test the setup; rerun the job with '
               'NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL and TORCH_NCCL_TRACE_BUFFER_SIZE=2000 (with '
               'TORCH_NCCL_DUMP_ON_TIMEOUT=1) so the next failure leaves what `ddpdoctor explain` reads; give it every'
               " rank's output (torchrun --log-dir, srun --output=%t.log).")),
    _code("LOG001", _CRITICAL, "explain",
          why=('The caching allocator could not get the memory it asked for on this GPU. When only some ranks run out,'
               " those ranks hold more than the others: more data, rank-0-only work, or another rank's context on "
               'their GPU.'),
          fix=("Lower the per-GPU batch size or sequence length, enable activation checkpointing or mixed precision; "
               "if only some ranks run out, look for extra work or tensors on those ranks (rank 0 evaluation, "
               "metrics gathered to one rank) and for other ranks' CUDA contexts on their GPU (a missing "
               "torch.cuda.set_device(local_rank)); `ddpdoctor check` shows contexts per GPU (GPU004).")),
    _code("LOG002", _CRITICAL, "explain",
          per_case="four DataLoader failures (worker killed, out of /dev/shm, exited, timed out): each its own cause and fix"),
    _code("LOG003", _CRITICAL, "explain",
          why=("Some parameters took no part in the loss in the previous iteration, so DDP's reducer never finished "
               'that iteration\'s all-reduce ("Expected to have finished reduction in the prior iteration").'),
          fix=('Pass find_unused_parameters=True to DistributedDataParallel (it costs a graph traversal per step), or '
               'make every parameter part of the loss each step; TORCH_DISTRIBUTED_DEBUG=INFO names the parameters.')),
    _code("LOG004", _CRITICAL, "explain",
          why=('DistributedDataParallel checks at construction that every rank has the same parameters (count, '
               'shapes); these ranks built another model.'),
          fix=('Build the model the same way on every rank (same config, same code path; no rank-dependent layers), '
               'and load checkpoints before wrapping in DDP on every rank.')),
    _code("LOG005", _CRITICAL, "explain",
          why=('The store could not listen on MASTER_PORT (EADDRINUSE): another job on this node uses the port, or a '
               "previous run's process is still alive."),
          fix=('Pick a free MASTER_PORT per job (torchrun --master-port, or --rdzv-endpoint host:0 with standalone), '
               "or find the holder with `ss -ltnp 'sport = :PORT'` and stop it.")),
    _code("LOG006", _CRITICAL, "explain",
          per_case="the store of init_process_group (MASTER_ADDR) or torchrun's elastic endpoint (--rdzv-endpoint)"),
    _code("LOG007", _CRITICAL, "explain",
          per_case="NCCL's socket error, no usable interface, or an InfiniBand/RoCE error: each its own setting to fix"),
    _code("LOG008", _CRITICAL, "explain",
          why=("The scheduler stopped the job (Slurm's time limit, preemption, scancel or a lost node; Kubernetes "
               "killing a container over its memory limit, OOMKilled, or evicting the pod); the ranks' errors after "
               'it are fallout.'),
          fix=('Time limit: ask for more (--time) and checkpoint to resume. Preemption or a lost node: requeue '
               '(--requeue, a restartPolicy) and resume from a checkpoint. OOMKilled: raise the container\'s memory '
               'limit or use less host memory per rank.')),
    _code("LOG009", _CRITICAL, "explain",
          why=('A kernel failed on the GPU. An illegal memory access or a device-side assert is a bug in the model or '
               'a custom kernel (an index out of range in an embedding or loss is the usual one); an ECC error is '
               'faulty hardware. The CUDA context is unusable afterwards, so every later call fails too.'),
          fix=('Rerun with CUDA_LAUNCH_BLOCKING=1 to get the failing line; for device-side asserts, run one step on '
               'CPU to see the Python error. For ECC errors, drain the node and run `ddpdoctor check` (HOM007).')),
    _code("LOG010", _CRITICAL, "explain",
          why=('The thread that watches collectives stopped making progress, which happens when a CUDA or NCCL call '
               'blocks inside the driver (a hung GPU, a stuck NVLink/PCIe transfer), not a Python-level hang.'),
          fix=("Check the node's GPUs (`nvidia-smi`, `dmesg | grep -i xid`); collect the Flight Recorder dump "
               '(TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT=1) to see the last collective.')),
    _code("LOG011", _INFO, "explain",
          why='Every dumped rank recorded the same collectives with the same shapes and dtypes: no desync.'),
    _code("LOG012", _CRITICAL, "explain",
          why=('The rank was killed by SIGKILL (exit code -9, or 137 from a shell or container) and printed no error '
               "of its own: most often the kernel's out-of-memory killer (host memory, not GPU memory), otherwise a "
               'scheduler or a user (`kill -9`, a job step ended by force).'),
          fix=("Check `dmesg | grep -i -E 'oom|killed process'` (or `journalctl -k`) on that node around the time; if "
               'host memory ran out, run fewer ranks per node, fewer DataLoader workers or a smaller prefetch, or '
               'memory-map the dataset instead of loading it in every rank.')),
    _code("LOG013", _CRITICAL, "explain",
          why=('The rank died of a segmentation fault (signal 11, exit code -11 or 139): native code (a CUDA or NCCL '
               'library, a compiled extension, a mismatched build) touched memory it must not. A debugging or '
               'tuning switch the job exports can make it: torch 2.13 crashes every rank in DistributedDataParallel('
               'model) under TORCH_DISTRIBUTED_DEBUG=DETAIL.'),
          fix=('Run `ddpdoctor check` with the job\'s environment: where a stage crashes, it runs it again without '
               'the switches that change torch\'s, NCCL\'s or CUDA\'s behaviour (TORCH_DISTRIBUTED_DEBUG, '
               'CUDA_LAUNCH_BLOCKING, NCCL_ALGO, PYTORCH_CUDA_ALLOC_CONF, ...) and names the one that makes it '
               '(RUN013). Otherwise rerun that rank with `python -X faulthandler` (or PYTHONFAULTHANDLER=1) to get '
               'the Python stack at the crash; check that torch, CUDA, NCCL and compiled extensions come from '
               "matching builds; a core dump (`ulimit -c unlimited`) and `gdb python core` show the native frame.")),
    _code("LOG014", _CRITICAL, "explain",
          why=('The rank aborted (SIGABRT, exit code -6 or 134): a C++ exception nobody caught (`terminate called '
               "after throwing an instance of 'c10::Error'`), a failed internal assertion, or NCCL's watchdog "
               'ending a rank whose collective failed.'),
          fix=("Read the lines that rank printed just before the abort (`what():`, the C++ message): they name the "
               'failed call; rerun with TORCH_SHOW_CPP_STACKTRACES=1 for the C++ stack.')),
    _code("LOG015", _CRITICAL, "explain",
          why=('The launcher itself received SIGHUP, SIGTERM or SIGINT and stopped its workers: the terminal session '
               'closed (an ssh logout without nohup/tmux), Ctrl-C, or the scheduler or a supervisor ended it. The '
               'workers were stopped, they did not fail.'),
          fix=('Run long jobs detached from the terminal (tmux, screen, nohup, a batch job); if the scheduler sent '
               "it, see its accounting (`sacct -j JOB`, `kubectl describe pod`) for why (time limit, preemption).")),
    _code("RUN001", _CRITICAL, "run",
          per_case=("check words it from what the missing ranks printed (why_not_arrived: refused, no answer, an "
                    "unresolved name) and whether whole nodes are gone; explain from the store's count or torchrun's "
                    "elastic rendezvous")),
    _code("RUN002", _CRITICAL, "run",
          per_case=("check knows the signal or exit code, whether it was injected or out of memory; explain reads "
                    "torchrun's or srun's summary, Slurm's OOM kill, or only the peers' closed connections")),
    _code("RUN003", _CRITICAL, "run",
          per_case="check knows the stage and whether the error was injected or out of memory; explain only the exception"),
    _code("RUN004", _CRITICAL, "run",
          why=("These ranks never issued the collective their peers were waiting in: they were stuck in their own "
               "code (data loading, a lock, I/O, a rank-dependent branch, a hung GPU) or had left the loop, and every "
               "other rank was blocked waiting for them. The network is not the problem."),
          fix=("Find where the named ranks were: their Python stack (in the evidence, or `py-spy dump --pid PID` on a "
               "live hang), or their last collective in the Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE=2000 with "
               "TORCH_NCCL_DUMP_ON_TIMEOUT=1). The usual causes are data loading, a lock, I/O, or a rank-dependent "
               "branch or hook before the collective, and uneven batches per rank (DistributedSampler(drop_last=True),"
               " the Join context). Raise --timeout only if the stage is legitimately slow.")),
    _code("RUN005", _CRITICAL, "run",
          why=('Its heartbeat stopped while the process still existed: it is frozen (stopped by a signal, swapping, or'
               ' stuck in native code holding the interpreter lock), or its node lost the network.'),
          fix='Log in to that host and run `py-spy dump --pid PID`; check `dmesg` and memory pressure there.'),
    _code("RUN006", _CRITICAL, "run",
          why='ddpdoctor was stopped before every probe finished; every rank was terminated.',
          fix='Run the check again and let it finish; every stage has its own deadline (--timeout).'),
    _code("RUN007", _CRITICAL, "run",
          why='Every rank must be started with the same WORLD_SIZE; these were launched with another value.',
          fix='Launch every node with the same --nnodes/--nproc_per_node (torchrun) or --ntasks (srun).'),
    _code("RUN008", _CRITICAL, "run",
          per_case=("check sees every rank inside one collective; explain sees NCCL's watchdog name one op, or only "
                    "waits, where a rank missing from the logs may be the cause")),
    _code("RUN009", _CRITICAL, "run",
          per_case=("seen in our marks, torch's Flight Recorder, TORCH_DISTRIBUTED_DEBUG=DETAIL, gloo's size check or "
                    "NCCL's watchdog: each knows something the others do not (gloo cannot say whose call differs)")),
    _code("RUN010", _INFO, "run",
          why='--inject or DDPDOCTOR_INJECT asked ddpdoctor to make ranks misbehave (a fire drill or a test).',
          fix='Run without --inject and without DDPDOCTOR_INJECT for a real check.'),
    _code("RUN011", _WARN, "run",
          fix='Report this bug to ddpdoctor with the JSON report attached.'),
    _code("RUN012", _WARN, "run",
          why=('NCCL needs a GPU on every rank, so ddpdoctor fell back to gloo on CPU for all ranks; a real training '
               'job would fail or run these ranks on CPU.'),
          fix=('Check CUDA_VISIBLE_DEVICES and the GPU request (--gres=gpu:N, --gpus-per-task) for the nodes of these '
               'ranks, and that the driver works there (`nvidia-smi`).')),
    _code("RUN013", _CRITICAL, "run",
          per_case=("check ran the failing stage again without the behaviour-changing settings the ranks had "
                    "(docs/runtime.md's table), then with each alone: the title names the one(s) it crashes with")),
    _code("SCL000", _OK, "scaling"),
    _code("SCL001", _WARN, "scaling",
          why=('With the same batch per rank, n ranks should process n times the samples per second; the table splits '
               'the time each size adds per step over one rank into its parts, measured on the ranks.')),
    _code("SCL002", _INFO, "scaling",
          why='Measured at the largest size on this model, each setting for the same number of steps.'),
    _code("SCL003", _INFO, "scaling",
          why=('DDP averages the gradients of n batches, so each optimizer step sees n times the samples. The linear '
               'rule (Goyal et al. 2017, with warm-up) suits SGD on large batches; the square-root rule (Krizhevsky '
               '2014, Hoffer et al. 2017) is the gentler choice, often used with Adam.')),
    _code("SCL004", _WARN, "scaling",
          why='Sizes that include these ranks are not judged.',
          fix="See the run's findings for what happened to them."),
    _code("SCL005", _INFO, "scaling",
          why=('Ranks that outnumber the CPU cores wait for a core in everything they do, the all-reduce included: the'
               ' lost time shows up as communication and slower computation, but its cause is the host.'),
          fix='Measure with at most one rank per core (or per GPU): --sizes up to the CPU count, or a bigger host.'),
    _code("STR001", frozenset({Severity.CRITICAL, Severity.WARN}), "stragglers",
          severity_rule='CRITICAL when the straggler costs at least half a step, WARN below',
          why=('DDP is synchronous: every rank waits at each gradient all-reduce for the last one to arrive, so the '
               "whole job runs at this rank's pace.")),
    _code("STR002", _OK, "stragglers"),
    _code("STR003", _WARN, "stragglers",
          fix=('Shard the data with DistributedSampler(dataset, num_replicas=world_size, rank=rank) and the same '
               'batch_size on every rank; use drop_last=True (or pad) so every rank gets the same number of batches; '
               'for variable-length samples, balance tokens per rank (a length-grouped sampler).')),
    _code("STR004", _WARN, "stragglers",
          why=('One rank holding extra state (metrics, a copy of the model or of the dataset, logging on rank 0) sets '
               'the memory limit, and so the batch size, for all of them.'),
          fix=('Keep rank-0-only work (evaluation, checkpoint gathering, logging buffers) small or off the GPU, and '
               'free it before training steps.')),
    _code("STR005", _INFO, "stragglers",
          why='No rank makes the others wait; the all-reduce itself takes as long as the rest of the step.',
          fix=('Measure the interconnect with `ddpdoctor allreduce-bench`; larger per-rank batches or gradient '
               "accumulation (no_sync) amortise communication; check DDP's bucket_cap_mb.")),
    _code("STR006", _INFO, "stragglers",
          why=('Ranks that wait for a straggler or for data idle their GPU; the busiest GPU is the one the others wait'
               ' for.'),
          fix='See the straggler and data findings; utilisation evens out when the slow rank is fixed.'),
    _code("STR007", _INFO, "stragglers",
          why='A verdict on one rank, or on a handful of steps, would be noise.',
          fix='Run with more ranks, or drop --steps to measure for --straggler-seconds.'),
    _code("STR008", _INFO, "stragglers",
          why=('Short bursts (another process, a page-cache flush, a checkpoint on a shared disk) slow a rank for a '
               'while.'),
          fix='If it recurs, run again with --straggler-seconds 30 to see whether it persists.'),
    _code("TOP001", _WARN, "topology",
          why=('The link trained below what the GPU and its slot support, so every copy between host and GPU, and any '
               'all-reduce that goes over PCIe, has less bandwidth. Read while the GPU was busy, so this is not the '
               'power saving of an idle link.')),
    _code("TOP002", frozenset({Severity.CRITICAL, Severity.WARN, Severity.INFO}), "topology",
          severity_rule=('CRITICAL with no NVLink left, WARN with some down, INFO where NVML cannot tell or the job '
                         'does not use the GPU'),
          why=("NCCL routes around a missing NVLink: with some links down this GPU's traffic shares fewer links, with "
               'all down it falls back to PCIe and host memory, several times slower; every all-reduce of the job '
               'waits for it.')),
    _code("TOP003", _WARN, "topology",
          why=("Every ring or tree through this GPU crosses a slower path (the CPU's host bridge or the socket "
               "interconnect) than the others use, so the whole all-reduce runs at that path's speed."),
          fix=('Run on GPUs that share a switch or socket (choose them with CUDA_VISIBLE_DEVICES; in Slurm, '
               "`--gpus-per-node` with `--gpu-bind=closest`), or ask the admins whether this GPU's NVLink or slot is "
               'as designed (`nvidia-smi topo -m`).')),
    _code("TOP004", _WARN, "topology",
          why=('These GPUs sit behind one PCIe switch (or share NVLink), so their data could go GPU to GPU; without '
               'P2P, NCCL stages every byte in host memory ("via SHM" instead of "via P2P/IPC" in NCCL_DEBUG=INFO '
               'output), at a fraction of the bandwidth. The usual causes are PCIe ACS enabled on the switch, an IOMMU'
               ' in translation mode, a VM without P2P passthrough, or NCCL_P2P_DISABLE.'),
          fix=('Check `nvidia-smi topo -p2p r` (it should say OK). Disable ACS on the PCIe switches (BIOS, or `setpci`'
               " at boot) and boot with `iommu=pt` (or the IOMMU off), as NCCL's troubleshooting guide describes; in a"
               ' VM, enable P2P in the hypervisor. Make sure NCCL_P2P_DISABLE is not set.')),
    _code("TOP005", _WARN, "topology",
          why=('Data loading, kernel launches and host-to-GPU copies of such a rank cross the socket interconnect, and'
               ' its pinned memory lives on the far node: slower steps, and the one rank everyone else waits for.'),
          fix=("Bind each rank to its GPU's NUMA node: in Slurm `srun --cpu-bind=cores --gpu-bind=closest`; by hand "
               '`numactl --cpunodebind=N --membind=N` per rank; or remove a wrong `taskset`/cgroup cpuset. `nvidia-smi'
               " topo -m` shows each GPU's CPU Affinity and NUMA Affinity.")),
    _code("TOP006", _INFO, "topology",
          why=('Not an error: the scheduler may keep each rank near its GPU, or may not. Binding makes step times '
               'steadier on multi-socket hosts.'),
          fix=('Optional: `srun --cpu-bind=cores --gpu-bind=closest`, or `numactl --cpunodebind=N --membind=N` with N '
               "the GPU's NUMA node from `nvidia-smi topo -m`.")),
    _code("TOP007", _INFO, "topology",
          why=('What `ddpdoctor allreduce-bench` (or nccl-tests) should come close to on large messages; a measurement'
               ' far below it points at the machine.')),
    _code("TOP008", _WARN, "topology",
          why=('Replays are link-level retransmissions after errors: a marginal link (riser, slot, signal integrity) '
               'that costs bandwidth and may get worse. A healthy link replays rarely, if ever, in a quarter of a '
               'second.'),
          fix=('Watch `nvidia-smi -q -d PCIE` (Replays Since Reset) while training; node health checkers fail a GPU at'
               ' 80 replays over their test. Reseat the GPU or riser; drain the node if it keeps counting.')),
    _code("TOP009", _INFO, "topology",
          why='Without NVML there are no GPU links to judge; ranks run on CPU (gloo).'),
    _code("TOP010", _INFO, "topology",
          why="The slot (or the CPU's root port) caps the link below the GPU's own generation.",
          fix='Nothing to repair; a newer platform or slot would double host-to-GPU bandwidth per generation.'),
    _code("TOP011", frozenset({Severity.WARN, Severity.INFO}), "topology",
          severity_rule=("WARN where as many GPUs of this node with no pair across the sockets exist (the job could "
                         "use them), and for a 2-GPU job whose one pair is SYS (its whole all-reduce is that hop, and "
                         "two GPUs never need two sockets); INFO where the job needs GPUs of both sockets"),
          why=("`nvidia-smi topo -m` says SYS: the path crosses PCIe and the interconnect between the CPU sockets "
               "(QPI/UPI, Infinity Fabric). GPUs cannot reach each other peer to peer over it on most platforms, so "
               "NCCL copies each byte through host memory across the sockets, and every all-reduce of the job runs at "
               "that hop's speed: about 40% of the PCIe link (6 GB/s at Gen3 x16, 13 at Gen4, 25 at Gen5) against "
               "80% for GPUs under one PCIe switch. Nothing is broken; it is how the machine is built.")),
    _code("TOP012", frozenset({Severity.WARN, Severity.INFO}), "topology",
          severity_rule="WARN when the job spans nodes (its traffic between nodes goes this way), INFO when it does not",
          why=("A GPU and a NIC on different sockets (SYS) cannot use GPUDirect RDMA: NCCL stages the GPU's traffic to "
               "other nodes in host memory and sends it across the socket interconnect first (NCCL_DEBUG=INFO shows "
               "the channel without GDRDMA). A job that spans nodes gets less than the NIC's rate on those GPUs, and "
               "all of them wait for the slowest."),
          fix=("Multi-node jobs: give each socket (each PCIe switch, ideally) its own NIC, or run on the GPUs near a "
               "NIC (CUDA_VISIBLE_DEVICES; Slurm `--gpu-bind=closest`); name the NIC each GPU should use with "
               "NCCL_IB_HCA only if it is near. Single-node jobs are not affected.")),
    _code("WATCH001", _CRITICAL, "watch",
          per_case=("the process never reached init_process_group (its rank may be unknown), or it called it and "
                    "waits for peers")),
    _code("WATCH002", _CRITICAL, "watch",
          why=('Rank 0 hosts the rendezvous store on MASTER_PORT. Another process already listens there (typically a '
               'second job with the same hard-coded port on this node), so init_process_group fails with "EADDRINUSE" '
               '/ "address already in use" on rank 0, and the other ranks may join the other job\'s store and hang.'),
          fix=('Give each job its own port: derive it from the job (e.g. MASTER_PORT = 10000 + SLURM_JOB_ID % 50000), '
               'pick a free one at start (bind port 0, read it, pass it to the ranks), or use torchrun --standalone; '
               'or wait for the other job to end.')),
)

CODES: Mapping[str, Code] = {entry.code: entry for entry in _ENTRIES}


def finding(code: str, probe: str, title: str, severity: Optional[Severity] = None, **fields: Any) -> Finding:
    """A finding in the catalogue's words: its severity (or one it allows, where the case decides)
    and its why and fix; the call site gives the title and evidence, and the why and fix only
    for a code worded per case, so one code cannot drift into two wordings."""
    entry = CODES[code]
    for text in ("why", "fix"):
        if getattr(entry, text) and text in fields:
            raise ValueError(f"{code} has its {text} in the catalogue; the call site must not word it again")
        fields.setdefault(text, getattr(entry, text))
    return Finding(code=code, severity=entry.allowed(severity), probe=probe, title=title, **fields)

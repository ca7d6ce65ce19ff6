"""Would running the job again help? A requeue verdict from an explanation, for job scripts.

A scheduler that requeues every failed job burns GPU hours on a bug that fails at the same
step every time; one that never requeues leaves a preempted job dead. The first cause the
diagnosis found says which: a transient fault (a network flap, a lost node, preemption, a
port clash) is worth a retry, a deterministic one (a Python bug, a shape mismatch, an out-of-
memory at the same step, a config error) is not, and a kill or crash with no reason in the
log is unknown. Deterministic and local: one table, read top to bottom, no model service.

`RULES` is that table, and docs/explain.md ("Requeue verdict and exit codes") prints it row for
row. A row matches the headline finding's code, and where it names them, the signature of the
log line the finding cites and a pattern searched in the finding's title and evidence (the
first matching row wins). A code with no row gets `DEFAULT`: unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from ddpdoctor.core.exits import (
    EXIT_OK, REQUEUE_NO_RETRY_EXIT, REQUEUE_RETRY_EXIT, REQUEUE_UNKNOWN_EXIT)
from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.explain.diagnosis import Explanation
from ddpdoctor.explain.events import cite

RETRY, NO_RETRY, UNKNOWN = "retry", "no_retry", "unknown"
EXIT_FOR = {RETRY: REQUEUE_RETRY_EXIT, NO_RETRY: REQUEUE_NO_RETRY_EXIT, UNKNOWN: REQUEUE_UNKNOWN_EXIT}
WORDS = {RETRY: "retry", NO_RETRY: "do not retry", UNKNOWN: "unknown"}


@dataclass(frozen=True)
class Rule:
    code: str
    verdict: str
    why: str  # completes "retry: ..." / "do not retry: ..."
    sig: Optional[str] = None  # the cited line's signature (explain/signatures.py), None: any
    when: Optional[str] = None  # a regex searched in the finding's title and evidence, None: always


@dataclass(frozen=True)
class Requeue:
    verdict: str  # retry | no_retry | unknown
    reason: str
    code: Optional[str]  # the finding the verdict rests on; None when nothing failed
    exit_code: int  # what `ddpdoctor explain --exit-code requeue` exits with

    @property
    def words(self) -> str:
        return WORDS[self.verdict]

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason, "code": self.code, "exit_code": self.exit_code}


_SCHEDULER_STOP = r"PREEMPT|[Pp]reempt|NODE.?FAIL|[Nn]ode fail|[Ee]vict|JOB REQUEUE"
_TIME_LIMIT = r"TIME ?LIMIT|[Tt]ime limit"
_OOM = r"OOMKilled|(?i:\boom[-_ ]?kill|out.of.memory)"
_UNRESOLVED = r"Name or service not known|Temporary failure in name resolution|gaierror"
_TRANSIENT_EXCEPTION = r"failed: (?:[\w.]+\.)?(?:Connection(?:Reset|Refused|Aborted)Error|DistNetworkError)\b"

RULES: tuple[Rule, ...] = (
    # -- deterministic: the same code, data and settings fail the same way again -----------
    Rule("RUN009", NO_RETRY, "the ranks called different collectives (a desync in the code) and will again"),
    Rule("LOG001", NO_RETRY, "a CUDA out-of-memory error recurs at the same step with the same batch"),
    Rule("LOG003", NO_RETRY, "DDP's unused-parameter error is in the model code and recurs at the same step"),
    Rule("LOG004", NO_RETRY, "the ranks build different models: a code or config difference"),
    Rule("GPU003", NO_RETRY, "ranks share a GPU: the device mapping is a setting, not luck"),
    Rule("GPU005", NO_RETRY, "an invalid device ordinal is the device mapping's error: the setting fails again"),
    Rule("GPU008", NO_RETRY, "the node's driver or GPU allocation does not fit this torch; the request must change",),
    Rule("LOG002", NO_RETRY, "/dev/shm is too small for the DataLoader: the container's setting fails again",
         sig="dataloader_shm"),
    Rule("LOG007", NO_RETRY, "NCCL's shared-memory segment does not fit the node's or pod's /dev/shm: the same spec "
         "fails again (enlarge /dev/shm or set NCCL_SHM_DISABLE=1 first)", sig="nccl_shm_error"),
    Rule("LOG007", NO_RETRY, "NCCL found no usable network interface: NCCL_SOCKET_IFNAME names one that is not there",
         sig="nccl_no_interface"),
    Rule("LOG007", NO_RETRY, "NCCL's sockets failed over the interface NCCL_SOCKET_IFNAME forces: the setting fails again",
         sig="nccl_system_error", when=r"NCCL_SOCKET_IFNAME on"),
    Rule("LOG009", RETRY, "an uncorrectable ECC error is a faulty GPU: requeue away from that node and drain it",
         when=r"ECC"),
    Rule("LOG009", NO_RETRY, "peer-to-peer access between these GPUs is not supported: the node fails the same way "
         "again (set NCCL_P2P_DISABLE=1 first)", sig="nccl_ipc_failure"),
    Rule("LOG009", UNKNOWN, "NCCL's unhandled cuda error does not say which CUDA call failed: a bug, a full GPU or "
         "a bad one", sig="nccl_unhandled_cuda"),
    Rule("LOG009", NO_RETRY, "an illegal memory access or device-side assert is a bug in a kernel or its indices"),
    Rule("RUN002", NO_RETRY, "the kernel's out-of-memory killer ended a rank: the same host memory use is killed again",
         sig="slurm_oom"),
    Rule("LOG012", NO_RETRY, "a rank killed (SIGKILL) with out-of-memory evidence is killed again at the same use",
         when=_OOM),
    Rule("LOG008", NO_RETRY, "the container hit its memory limit (OOMKilled): the same use is killed again",
         when=_OOM),
    Rule("RUN003", RETRY, "the rank's connection was reset or refused: a network or peer fault, not the code",
         sig="python_exception", when=_TRANSIENT_EXCEPTION),
    Rule("RUN003", RETRY, "the rendezvous host's name did not resolve: its pod or node was not up yet",
         sig="python_exception", when=_UNRESOLVED),
    Rule("RUN003", UNKNOWN, "the launcher's report of a rank that died of a signal or exited non-zero: the rank's own "
                            "error is not in the log", sig="python_exception", when=r"CalledProcessError"),
    Rule("RUN003", UNKNOWN, "the rank was interrupted (SIGINT): by a person or a launcher, the log does not say",
         sig="python_exception", when=r"failed: KeyboardInterrupt"),
    Rule("RUN003", NO_RETRY, "an exception in the program (a bug, a missing file, a config error) raises again"),
    # -- transient: the network, a node or the scheduler, not the job -------------------------
    Rule("LOG005", RETRY, "the rendezvous port was taken by another process: a port clash"),
    Rule("LOG006", RETRY, "the rendezvous store could not be reached: its host started late or the network dropped"),
    Rule("RUN001", RETRY, "the rendezvous timed out before every rank arrived: a node started late or was lost"),
    Rule("LOG007", RETRY, "every failing InfiniBand/RoCE pair shares one end: a bad link or node, requeue without it",
         sig="nccl_ib_error", when=r"every failing pair has"),
    Rule("LOG008", RETRY, "the scheduler preempted or requeued the job, or lost its node: not the job's fault",
         when=_SCHEDULER_STOP),
    Rule("LOG015", RETRY, "the launcher got SIGHUP: its terminal session closed, nothing failed",
         when=r"SIGHUP|[Rr]eceived 1 death signal"),
    # -- unknown: the log shows how the job ended, not whether it would end so again ----------
    Rule("LOG008", UNKNOWN, "the job reached its time limit: a rerun gets further only if it resumes from a checkpoint",
         when=_TIME_LIMIT),
    Rule("LOG008", UNKNOWN, "someone cancelled the job: whether to run it again is their call"),
    Rule("LOG015", UNKNOWN, "the launcher was stopped from outside (SIGTERM, SIGINT): a scheduler, a platform or a "
                            "person, the log does not say which"),
    Rule("LOG012", UNKNOWN, "a rank was killed (SIGKILL) with no out-of-memory evidence: a scheduler, a person or "
                            "the OOM killer"),
    Rule("LOG013", UNKNOWN, "a segfault: a bug in native code recurs, a bad node or library build does not"),
    Rule("LOG014", UNKNOWN, "an abort (SIGABRT): a failed assertion in native code, or NCCL aborting a hung rank"),
    Rule("RUN002", UNKNOWN, "a rank was killed (SIGKILL) with no out-of-memory evidence: a scheduler, a person or "
                            "the OOM killer", when=r"SIGKILL|exitcode.{0,4}-9\b|Killed"),
    Rule("RUN002", UNKNOWN, "a rank crashed (segfault or abort) in native code: a bug recurs, a bad node does not",
         when=r"SIGSEGV|SIGABRT|SIGBUS|Segmentation|Aborted"),
    Rule("RUN002", UNKNOWN, "a rank ended with no error of its own in the log: its reason is in another file"),
    Rule("LOG002", UNKNOWN, "a DataLoader worker died or stalled (a kill, a crash, slow storage): the log does not say "
                            "whether it recurs"),
    Rule("LOG007", UNKNOWN, "an InfiniBand/RoCE error on one link: the peer died or the link flapped, the log does not "
                            "tell which", sig="nccl_ib_error"),
    Rule("LOG007", UNKNOWN, "NCCL's sockets failed: a network flap or a wrong interface, the log does not tell which"),
    Rule("LOG010", UNKNOWN, "NCCL's watchdog thread got stuck in the driver: a hung GPU, or a deadlock in the program"),
    Rule("RUN004", UNKNOWN, "a rank hung with no first cause in the log: a stall in the program or a stuck node"),
    Rule("RUN008", UNKNOWN, "every rank only waited: the transport or a rank missing from these logs, no first cause"),
)

DEFAULT = Rule("*", UNKNOWN, "ddpdoctor has no requeue rule for this finding")
NOTHING_FOUND = "no failure found in these logs: nothing to retry or stop"


def requeue_verdict(explanation: Explanation) -> Requeue:
    """The verdict on the headline finding: the first warning or critical one (the first cause)."""
    headline = next((f for f in explanation.findings if f.severity >= Severity.WARN), None)
    if headline is None:
        return Requeue(UNKNOWN, NOTHING_FOUND, None, EXIT_OK)
    rule = rule_for(headline, explanation)
    return Requeue(rule.verdict, rule.why, headline.code, EXIT_FOR[rule.verdict])


def rule_for(finding: Finding, explanation: Explanation) -> Rule:
    sigs = _cited_signatures(finding, explanation)
    text = f"{finding.title} {finding.evidence}"
    for rule in RULES:
        if rule.code == finding.code and (rule.sig is None or rule.sig in sigs) \
                and (rule.when is None or re.search(rule.when, text)):
            return rule
    return DEFAULT


def _cited_signatures(finding: Finding, explanation: Explanation) -> set[str]:
    """The signatures of the log lines a cause finding quotes as each rank's first error."""
    quoted = finding.evidence.get("first_error")
    if not isinstance(quoted, dict):
        return set()
    lines = set(quoted.values())
    return {e.sig for e in explanation.timeline if cite(e) in lines}

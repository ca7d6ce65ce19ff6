"""Do the ranks still train one model? The comparison of their replicas' digests, and its findings.

Pure: given each rank's digest (measure/replica_digest.py: per tensor the optimizer steps, the
exact sum of its bits; on a difference also its gradient's, both norms, and the optimizer's
settings), say which tensors differ, on which ranks, how far apart, and the cause where the
numbers tell it. Shared by the training callback (callback/replicas.py, at its checks) and
`check`'s ddp-smoke probe (after its own steps), so a job and a pre-flight check use one rule.

Why exact: DDP keeps replicas bit-identical when it works (every rank applies the same averaged
gradient with the same optimizer to the same weights; NCCL and gloo give every rank the same sum
within a call, and AMP's GradScaler, static_graph and the fp16/PowerSGD compression hooks keep
that). So any differing bit is a bug; its size says how much it matters: under a millionth of the
norm is "in the last bits" (warn), more is a divergence (critical).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ddpdoctor.core import codes
from ddpdoctor.core.findings import Finding, Severity, rank_ranges

PROBE = "callback"
LAST_BITS = 1e-6  # a relative difference of norms below this is rounding, above it a divergence
SHOWN = 8  # tensor names in a title or a list before "and N more"


@dataclass
class RankDigest:
    """One rank's replica, as gathered: per entry (a tensor the optimizer steps, or a group of them)."""

    rank: int
    params: list[float]  # exact bit sums
    settings: list[float]  # the optimizer's settings (measure/replica_digest.settings)
    grads: Optional[list[float]] = None  # bit sums of the gradients (-1: none)
    param_norms: Optional[list[float]] = None
    grad_norms: Optional[list[float]] = None


@dataclass
class EntryDiff:
    index: int
    names: tuple[str, ...]
    averaged: bool
    groups: list[list[int]]  # the ranks, grouped by equal value, largest group first
    rel_diff: Optional[float]  # the largest relative difference of the norms across ranks
    grads_equal: Optional[bool]  # the gradients are bit-equal across ranks (None: not read, or none)
    nonfinite_ranks: list[int] = field(default_factory=list)  # ranks whose weights hold NaN or inf
    nonfinite_grad_ranks: list[int] = field(default_factory=list)  # ranks whose gradients do


@dataclass
class Comparison:
    """What differs between the ranks' replicas."""

    entries: list[EntryDiff]
    settings: dict[str, dict[int, float]]  # name -> rank -> value, for the settings that differ
    ranks: list[int]

    @property
    def equal(self) -> bool:
        return not self.entries and not self.settings


def compare(digests: Mapping[int, RankDigest], names: Sequence[tuple[str, ...]], averaged: Sequence[bool],
            setting_names: Sequence[str]) -> Comparison:
    """Entry by entry and setting by setting, the ranks whose values differ from the majority's."""
    ranks = sorted(digests)
    out: list[EntryDiff] = []
    count = min(len(digests[r].params) for r in ranks) if ranks else 0
    for i in range(min(count, len(names))):
        values = {r: digests[r].params[i] for r in ranks}
        if len(set(values.values())) < 2:
            continue
        out.append(EntryDiff(i, names[i], averaged[i] if i < len(averaged) else True, _groups(values),
                             _rel_diff(digests, i), _grads_equal(digests, i), _nonfinite(digests, i, grads=False),
                             _nonfinite(digests, i, grads=True)))
    settings: dict[str, dict[int, float]] = {}
    for j, name in enumerate(setting_names):
        values = {r: digests[r].settings[j] for r in ranks if j < len(digests[r].settings)}
        if len(set(values.values())) > 1:
            settings[name] = values
    return Comparison(out, settings, ranks)


def _groups(values: Mapping[int, float]) -> list[list[int]]:
    by: dict[float, list[int]] = {}
    for r, v in sorted(values.items()):
        by.setdefault(v, []).append(r)
    return sorted(by.values(), key=lambda rs: (-len(rs), rs))


def _rel_diff(digests: Mapping[int, RankDigest], i: int) -> Optional[float]:
    norms = [d.param_norms[i] for d in digests.values() if d.param_norms is not None and i < len(d.param_norms)]
    finite = [n for n in norms if math.isfinite(n)]
    if len(finite) < 2 or len(finite) < len(norms):
        return None
    top = max(abs(n) for n in finite)
    return (max(finite) - min(finite)) / top if top > 0 else 0.0


def _grads_equal(digests: Mapping[int, RankDigest], i: int) -> Optional[bool]:
    grads = [d.grads[i] for d in digests.values() if d.grads is not None and i < len(d.grads)]
    if len(grads) < len(digests) or any(g == -1 for g in grads):
        return None
    return len(set(grads)) == 1


def _nonfinite(digests: Mapping[int, RankDigest], i: int, grads: bool) -> list[int]:
    out = []
    for r, d in sorted(digests.items()):
        norms = d.grad_norms if grads else d.param_norms
        if norms is not None and i < len(norms) and not math.isfinite(norms[i]):
            out.append(r)
    return out


@dataclass(frozen=True)
class Seen:
    """When the callback saw it: the last check with equal replicas and the first with a difference."""

    first_seen_step: int
    last_equal_step: Optional[int]
    bypassed_ddp: bool = False  # DDP's forward was never called (the reducer counted no iteration)
    nonfinite_loss: Optional[str] = None  # which rank's loss went non-finite first (judge/losses.said), if any
    first_step: Optional[int] = None  # the first step whose weights differ, from the per-step record (if kept)


def findings(comparison: Comparison, seen: Seen, hosts: Mapping[int, str], probe: str = PROBE) -> list[Finding]:
    """One finding per cause: the settings that differ (DOC014), non-finite values (DOC017), and the
    weights that differ (DOC013) with the cause the numbers tell."""
    out: list[Finding] = []
    if comparison.settings:
        out.append(_settings_finding(comparison, seen, hosts, probe))
    nonfinite = sorted({r for e in comparison.entries for r in e.nonfinite_ranks})
    if nonfinite:
        out.append(_nonfinite_finding(comparison, nonfinite, seen, hosts, probe))
    if comparison.entries:
        out.append(_weights_finding(comparison, seen, hosts, probe, nonfinite))
    return out


def _when(seen: Seen) -> str:
    if seen.first_step is not None:
        return f"since step {seen.first_step} (the first step whose weights differ, equal after step {seen.first_step - 1})"
    if seen.last_equal_step is None:
        return f"at step {seen.first_seen_step}, the first compared"
    return f"since step {seen.last_equal_step + 1}-{seen.first_seen_step} (equal at step {seen.last_equal_step})"


def _nodes(hosts: Mapping[int, str], ranks: Sequence[int]) -> tuple[str, ...]:
    return tuple(sorted({hosts[r] for r in ranks if r in hosts}))


def _minority(entries: Sequence[EntryDiff], ranks: Sequence[int]) -> list[int]:
    """The ranks outside the largest group of any differing entry (all of them when no group is larger)."""
    odd: set[int] = set()
    for e in entries:
        if len(e.groups) > 1 and len(e.groups[0]) > len(e.groups[1]):
            odd.update(r for g in e.groups[1:] for r in g)
        else:
            odd.update(ranks)
    return sorted(odd)


def _names(entries: Sequence[EntryDiff]) -> str:
    names = [n for e in entries for n in e.names]
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _weights_finding(comparison: Comparison, seen: Seen, hosts: Mapping[int, str], probe: str,
                     nonfinite: list[int]) -> Finding:
    entries = comparison.entries
    ranks = _minority(entries, comparison.ranks)
    diffs = [e.rel_diff for e in entries if e.rel_diff is not None]
    largest = max(diffs) if diffs else None
    cause, fix, explained_by = _cause(comparison, seen, nonfinite)
    rounding = largest is not None and largest < LAST_BITS and not nonfinite
    tensors = sum(len(e.names) for e in entries)
    apart = ("in the last bits only" if rounding else
             f"norms up to {100 * largest:.3g}% apart" if largest is not None else "")
    where = (f"on rank {rank_ranges(ranks)} against the others" if len(ranks) < len(comparison.ranks)
             else f"between ranks {rank_ranges(ranks)}")
    title = (f"Weights differ between ranks (the model diverged across ranks): {tensors} tensor"
             f"{'s' if tensors != 1 else ''} ({_names(entries)}) {where}, {_when(seen)}"
             + (f", {apart}" if apart else "") + f": {cause}")
    return codes.finding(
        "DOC013", probe, title,
        severity=Severity.WARN if rounding else Severity.CRITICAL,
        ranks=tuple(ranks), nodes=_nodes(hosts, ranks), fix=fix,
        why=("DDP keeps every rank's replica bit-identical only while each applies the same averaged gradient with "
             "the same optimizer to the same weights; once they differ, the ranks train different models, the loss "
             "on rank 0 says nothing of the others, and the checkpoint is one rank's model among several."),
        evidence={"tensors": [{"names": list(e.names), "rank_groups": [rank_ranges(g) for g in e.groups],
                               "averaged_by_ddp": e.averaged,
                               "norm_rel_diff": None if e.rel_diff is None else float(f"{e.rel_diff:.3g}"),
                               "gradients_equal": e.grads_equal} for e in entries[:64]],
                  "tensors_differing": tensors, "largest_norm_rel_diff": largest,
                  "first_seen_step": seen.first_seen_step, "last_equal_step": seen.last_equal_step,
                  "first_differing_step": seen.first_step, "cause": cause, "explained_by": explained_by})


def _cause(comparison: Comparison, seen: Seen, nonfinite: list[int]) -> tuple[str, str, Optional[str]]:
    """(cause, fix, the code of the finding that explains it) from what the numbers show."""
    entries = comparison.entries
    outside = [e for e in entries if not e.averaged]
    if outside:
        return (f"the optimizer steps {_names(outside)}, whose gradients DDP does not average: each rank moves "
                "its own copy",
                ("Make it a registered parameter of the module DDP wraps (nn.Parameter set as an attribute of that "
                 "module, before DDP(...)), or all-reduce its gradient yourself before optimizer.step()."), "DOC012")
    if seen.bypassed_ddp:
        return ("DDP averaged no gradient (DOC015): the loss is computed through model.module(...), or every backward "
                "is under no_sync()",
                ("Call the DDP-wrapped model itself in the training step (ddp_model(x), not ddp_model.module(x)), and "
                 "run the last micro-batch of each accumulation outside no_sync()."), "DOC015")
    if comparison.settings:
        return ("the optimizer's settings differ between ranks (DOC014)",
                "Give every rank the same optimizer settings and step schedulers on every rank alike.", "DOC014")
    if nonfinite:
        began = f"; {seen.nonfinite_loss}" if seen.nonfinite_loss else ""
        return (f"rank {rank_ranges(nonfinite)} holds non-finite values (DOC017): a step skipped or taken on some "
                f"ranks only{began}",
                "Decide to skip a step on every rank alike (all-reduce the non-finite flag first); find the NaN's source.",
                "DOC017")
    equal_grads = [e.grads_equal for e in entries if e.grads_equal is not None]
    if equal_grads and all(equal_grads):
        return ("the same gradients, different weights after the step: the weights were changed outside the "
                "optimizer on some ranks (a clamp, renorm or load_state_dict under `if rank == 0:`), or the "
                "optimizer's state (momentum, Adam's moments) differs, loaded on one rank only",
                ("Change weights on every rank alike (not inside rank-0-only logging or evaluation code), load "
                 "checkpoints and optimizer state on every rank, or broadcast from rank 0 after changing them."), None)
    if equal_grads and not any(equal_grads):
        return ("their gradients differ between ranks: DDP did not average them (a parameter frozen when DDP was "
                "built and unfrozen since, a module replaced after wrapping, a parameter unused in the forward, "
                "a loss computed through model.module(...), or every micro-batch's backward under no_sync())",
                ("Build DDP after the model's final structure and requires_grad; compute the loss through the DDP "
                 "model, not model.module; leave the last micro-batch of an accumulation outside no_sync(); set "
                 "find_unused_parameters=True for parameters some steps skip."),
                None)
    return ("the numbers do not tell why", "Compare the named tensors' updates on the ranks named.", None)


def _settings_finding(comparison: Comparison, seen: Seen, hosts: Mapping[int, str], probe: str) -> Finding:
    settings = comparison.settings
    first = next(iter(settings))
    values = settings[first]
    groups = _groups(values)
    ranks = sorted(r for g in groups[1:] for r in g) if len(groups) > 1 and len(groups[0]) > len(groups[1]) \
        else sorted(values)
    said = ", ".join(f"{v:g} on rank {rank_ranges(sorted(r for r, x in values.items() if x == v))}"
                     for v in sorted(set(values.values())))
    more = f" (and {len(settings) - 1} more setting{'s' if len(settings) > 2 else ''})" if len(settings) > 1 else ""
    return codes.finding(
        "DOC014", probe,
        f"Optimizer settings differ between ranks at step {seen.first_seen_step}: {first} is {said}{more}",
        ranks=tuple(ranks), nodes=_nodes(hosts, ranks),
        evidence={"settings": {name: {str(r): v for r, v in vals.items()} for name, vals in settings.items()},
                  "step": seen.first_seen_step})


def _nonfinite_finding(comparison: Comparison, ranks: list[int], seen: Seen, hosts: Mapping[int, str],
                       probe: str) -> Finding:
    entries = [e for e in comparison.entries if e.nonfinite_ranks]
    finite = [r for r in comparison.ranks if r not in ranks]
    grads = sorted({r for e in entries for r in e.nonfinite_grad_ranks})
    tail = (f"; rank {rank_ranges(finite)}'s are finite" if finite else "") + (
        f", the gradients are non-finite on rank {rank_ranges(grads)}: the step was taken where the weights went "
        "non-finite and skipped where they did not" if grads and finite else "")
    began = f" ({seen.nonfinite_loss})" if seen.nonfinite_loss else ""
    return codes.finding(
        "DOC017", probe,
        f"Non-finite weights (NaN or inf) in {_names(entries)} on rank {rank_ranges(ranks)} at step {seen.first_seen_step}"
        + tail + began,
        ranks=tuple(ranks), nodes=_nodes(hosts, ranks),
        evidence={"tensors": [list(e.names) for e in entries[:64]], "step": seen.first_seen_step,
                  "nonfinite_gradients_on": grads, "finite_weights_on": finite})


def buffers_finding(step: int, names: Sequence[str], groups: Sequence[Sequence[int]], never_broadcast: bool,
                    ignored: Sequence[str], hosts: Mapping[int, str], probe: str = PROBE) -> Finding:
    """DOC019: buffers that differ between ranks just after DDP's broadcast (callback/buffers.py)."""
    ranks = (sorted(r for g in groups[1:] for r in g) if len(groups) > 1 and len(groups[0]) > len(groups[1])
             else sorted(r for g in groups for r in g))
    everyone = sorted(r for g in groups for r in g)
    where = (f"on rank {rank_ranges(ranks)} against the others" if len(ranks) < len(everyone)
             else f"between ranks {rank_ranges(ranks)}")
    shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    if never_broadcast:
        cause = ("the model had no buffer when DDP(...) was built, so DDP broadcasts none: it reads the buffers "
                 "again only when it broadcasts")
    elif ignored and len(ignored) == len(names):
        cause = "DDP was told to ignore them (_set_params_and_buffers_to_ignore_for_model)"
    else:
        cause = "DDP's broadcast did not reach them"
    return codes.finding(
        "DOC019", probe,
        (f"Buffers differ between ranks just after DDP's broadcast: {len(names)} buffer{'s' if len(names) != 1 else ''} "
         f"({shown}) {where}, at the forward of step {step}: {cause}; each rank keeps its own, and a checkpoint "
         "saved by rank 0 keeps rank 0's (of the buffers it saves: not those registered with persistent=False)"),
        ranks=tuple(ranks), nodes=_nodes(hosts, ranks),
        evidence={"buffers": list(names[:64]), "count": len(names), "rank_groups": [rank_ranges(g) for g in groups],
                  "step": step, "ddp_broadcasts_no_buffer": never_broadcast, "ignored_by_ddp": list(ignored[:64]),
                  "cause": cause})

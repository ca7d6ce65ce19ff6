"""Find one or two slow nodes among many in O(log N) rounds of concurrent, disjoint group timings.

Timing every pair of N nodes is N(N-1)/2 timings in N-1 rounds; at 1,024 nodes that is half a
million timings. A group's all-reduce (a ring over one rank per member) is as fast as its
slowest member's link, so a group that is fast clears every member at once, and a slow group
holds a slow node: adaptive group testing. The search times a few large groups that cover
every node (the screen), splits each slow group into parts timed in the next round, each padded
with nodes already cleared so no part is a lone rank, and so on down to single nodes, which are
timed again beside different cleared partners before one is named. Groups of one round share no
node, so they run at the same time: a round costs one group timing, however many groups it has.

Noise is the hard part: a busy host or a shared switch slows a timing by tens of percent, and
a slow node may be only twice as slow. So nothing is decided from one timing: each test (the
same suspects, timed round after round) is a sequential probability ratio test, on the
logarithm of busbw, between "healthy" and "at least `slow_factor` slower", with the noise
estimated from the timings themselves. A test that is not yet decisive is simply timed again
in the next round, beside the other work. A group is cleared only on strong evidence (a missed
slow node is the worse error), split on weaker evidence (a false alarm costs a round, no
blame), and a node is named only on strong evidence from at least `confirm` timings beside at
least two different partners, weighed once more against the final level before the end. A
test still unsettled after `max_times` timings is cleared only on a split's worth of evidence,
else split, or, for a single node, left unsure: said, never named.

"Healthy" is relative, read from the timings themselves: pairs of cleared nodes timed beside
the tests (controls), the screen less the groups that may hold a slow node, and every timing of
a test that leans healthy so far. So most of the screen must be clean: from 8 nodes the search
takes up to `max_slow` slow nodes, below that one. Below 2 x (2 x max_slow + 1) nodes the
screen is every pair (round-robin, disjoint pairs per round); above it, `screen_groups`
groups. More slow nodes than `max_slow` (or more than twice as many slow groups at once) is not
one node's fault (a switch, a rack, the fabric): the search stops as "widespread" and names none.

Pure, no torch: a planner driven by whoever times the groups (the allreduce probe on real
ranks; the unit tests and benchmarks/node_search_sim.py on a timing model).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

Group = tuple[str, ...]

FAST, SLOW, UNSURE, MERGED = "fast", "slow", "unsure", "merged"
ENOUGH_CONTROLS = 8  # control timings that make the healthy level without the screen's


@dataclass(frozen=True)
class SearchSettings:
    """The search's knobs; the defaults are what the simulation table was made with."""

    slow_factor: float = 2.0  # the least slowdown searched for: the alternative each test weighs
    max_slow: int = 2  # more slow groups than this at once: not a node's fault
    screen_groups: int = 16  # the first round's groups, at and above the pair-screen limit
    fanout: int = 2  # parts a slow group is split into (2: bisection)
    controls: int = 4  # groups of two cleared nodes timed beside the tests: the healthy level
    confirm: int = 3  # timings of a single node before it may be named
    prior_sigma: float = 0.3  # noise (sd of log busbw) assumed before any is measured
    prior_weight: int = 4  # ... worth this many measured deviations
    clear_odds: float = 1e4  # evidence needed to call a group fast (clears its members)
    split_odds: float = 1e2  # evidence needed to call a group slow (split it)
    blame_odds: float = 1e5  # evidence needed to name a single node
    max_times: int = 10  # timings of one test before it is decided on the balance of evidence
    max_rounds: int = 0  # 0: 6 * ceil(log2 N) + 20


@dataclass
class _Test:
    """Suspects timed together, round after round, until their group is fast or slow."""

    suspects: Group
    logs: list[float] = field(default_factory=list)  # log busbw of each timing
    groups: list[Group] = field(default_factory=list)  # the group each timing was of (suspects + partners)
    verdict: str = ""
    sure: bool = False  # slow on the evidence it takes to clear a group, not just to split one


@dataclass
class NodeEvidence:
    """A named or unsure node: its busbw in each group it was timed in, and the healthy level."""

    node: str
    busbw: list[float]
    groups: list[Group]
    healthy_busbw: float

    @property
    def ratio(self) -> float:
        """Its typical (median) timing over the healthy level."""
        return statistics.median(self.busbw) / self.healthy_busbw if self.healthy_busbw else 0.0


@dataclass
class SearchResult:
    """What the search found: the slow nodes (0, 1 or 2), nodes it could not settle, why it
    stopped, and what it cost."""

    slow: list[NodeEvidence]
    unsure: list[NodeEvidence]
    stopped: str  # "done", "widespread" (too many slow groups: no node named), "rounds", "stuck"
    rounds: int
    timings: int  # group timings, controls included
    groups: int  # distinct groups timed (each a process group to create)
    healthy_busbw: float

    @property
    def slow_nodes(self) -> list[str]:
        return [e.node for e in self.slow]


class NodeSearch:
    """The planner: `plan()` gives a round of disjoint groups, `record()` takes each group's
    busbw (in the same order), until `done`; then `result()`."""

    def __init__(self, nodes: Sequence[str], settings: SearchSettings = SearchSettings()) -> None:
        names = list(nodes)
        if len(names) < 4 or len(set(names)) != len(names):
            raise ValueError("the node search needs at least 4 distinct nodes (fewer: time every pair)")
        self.nodes = names
        # Slow is relative: most pairs must be clean for "healthy" to be read from them (at 4 to 7
        # nodes, that allows one slow node).
        self.max_slow = settings.max_slow
        pairs = len(names) * (len(names) - 1) // 2
        while self.max_slow > 1 and 2 * _pairs_touching(len(names), self.max_slow) > pairs:
            self.max_slow -= 1
        self.s = settings
        self.rounds = 0
        self.timings = 0
        self.cleared: set[str] = set()
        self.stopped = ""
        self._seen: set[Group] = set()
        self._screened = False  # every screen group timed once: a healthy level can be read
        self._controls: list[tuple[Group, float]] = []
        self._ref: list[float] = []
        self._round: list[tuple[Group, Optional[_Test]]] = []
        pair_screen = len(names) < 2 * (2 * self.max_slow + 1)
        screen = _all_pairs(names) if pair_screen else _split(names, min(settings.screen_groups, len(names) // 2))
        self._tests = [_Test(g) for g in screen]
        self._screen_size = len(self._tests)
        self._spoilable = _pairs_touching(len(names), self.max_slow) if pair_screen else self.max_slow
        self._max_rounds = settings.max_rounds or 6 * math.ceil(math.log2(len(names))) + 20

    @property
    def done(self) -> bool:
        return bool(self.stopped)

    def plan(self) -> list[Group]:
        """The next round's groups, no node in two; empty once done."""
        if self.done:
            return []
        if self._round:
            raise RuntimeError("record() the round planned before planning another")
        busy: set[str] = set()
        for test in self._pending():
            group = self._group_for(test, busy)
            if group:
                busy.update(group)
                self._round.append((group, test))
        if not self._round:
            self.stopped = "stuck"  # a single suspect and no cleared node to time it beside
            return []
        free = sorted(self.cleared - busy, key=self.nodes.index)
        for i in range(min(self.s.controls, len(free) // 2)):
            self._round.append(((free[2 * i], free[2 * i + 1]), None))
        return [g for g, _ in self._round]

    def record(self, busbw: Sequence[float]) -> None:
        """Each planned group's measured busbw (or 1/time), in plan order."""
        if len(busbw) != len(self._round):
            raise ValueError(f"{len(busbw)} figures for {len(self._round)} groups")
        if not all(math.isfinite(v) and v > 0 for v in busbw):
            raise ValueError("a group's busbw must be a positive number (one that did not finish has none)")
        for (group, test), value in zip(self._round, busbw):
            log = math.log(value)
            self._seen.add(group)
            if test is None:
                self._controls.append((group, log))
            else:
                test.logs.append(log)
                test.groups.append(group)
        self._round = []
        self.rounds += 1
        self.timings += len(busbw)
        self._screened = self._screened or all(t.logs for t in self._tests[:self._screen_size])
        if self._screened:
            self._decide()
        elif self.rounds >= self._max_rounds:
            self.stopped = "rounds"

    def result(self) -> SearchResult:
        level = math.exp(self._level()) if self._screened else 0.0
        named = [t for t in self._tests if len(t.suspects) == 1 and t.verdict == SLOW]
        unsure = [t for t in self._tests if len(t.suspects) == 1 and t.verdict in (UNSURE, "") and t.logs]
        stopped = self.stopped or "running"
        if stopped == "widespread" or len(named) > self.max_slow:
            stopped, unsure, named = "widespread", unsure + named, []
        return SearchResult(slow=[self._evidence(t, level) for t in named],
                            unsure=[self._evidence(t, level) for t in unsure],
                            stopped=stopped, rounds=self.rounds, timings=self.timings,
                            groups=len(self._seen), healthy_busbw=level)

    # -- deciding

    def _decide(self) -> None:
        self._weigh_reference()
        level, sigma = self._level(), self._sigma()
        for test in self._pending():
            if test.logs:
                test.verdict = self._verdict(test, level, sigma)
                if test.verdict == FAST:
                    self.cleared.update(test.suspects)
                elif test.verdict == SLOW and len(test.suspects) > 1:
                    test.sure = self._odds(test, level, sigma) <= -math.log(self.s.clear_odds)
                    self._split_test(test)
        self._narrow()
        if not self._pending():
            self._recheck(level, sigma)
        if self._slow_sets() > 2 * self.max_slow:
            self.stopped = "widespread"
        elif not self._pending():
            self.stopped = "done"
        elif self.rounds >= self._max_rounds:
            self.stopped = "rounds"

    def _recheck(self, level: float, sigma: float) -> None:
        """Before the end, every node about to be named is weighed again against the level as
        it now stands (read from more timings than when it was judged); one that no longer
        passes is timed again."""
        for test in self._tests:
            if test.verdict == SLOW and len(test.suspects) == 1 and self._verdict(test, level, sigma) != SLOW:
                test.verdict = ""

    def _narrow(self) -> None:
        """A suspect cleared elsewhere is no longer suspected in any other test: a slow group's
        slow node is among its members not cleared. A narrowed test with the suspects of another
        is dropped ("merged") where other tests hold all its suspects, so a node is judged by one
        test at a time; a narrowed slow one is split again, or, down to one node, timed until
        that node is confirmed or cleared."""
        live = [t for t in self._tests if t.verdict not in (FAST, MERGED)]
        changed: list[_Test] = []
        for test in live:
            left = tuple(n for n in test.suspects if n not in self.cleared)
            if left != test.suspects:
                test.suspects = left
                changed.append(test)
        for test in changed:
            others = {n for t in self._tests if t is not test and t.verdict not in (FAST, MERGED) for n in t.suspects}
            if not test.suspects:
                test.verdict = FAST
            elif others.issuperset(test.suspects):
                test.verdict = MERGED
            else:
                if test.verdict == SLOW and len(test.suspects) == 1:
                    test.verdict = ""
                elif test.verdict == SLOW:
                    self._split_test(test)

    def _verdict(self, test: _Test, level: float, sigma: float) -> str:
        """The sequential test: log-odds of healthy over `slow_factor` slower, from every timing."""
        odds = self._odds(test, level, sigma)
        k = len(test.logs)
        single = len(test.suspects) == 1
        if odds >= math.log(self.s.clear_odds):
            return FAST
        blame = self.s.blame_odds if single else self.s.split_odds
        if odds <= -math.log(blame) and (not single or self._confirmed(test)):
            return SLOW
        if k >= self.s.max_times:  # still not settled: cleared on a split's worth of evidence, not
            # on a guess; else a group is split, a node left unsure (said, not named)
            return FAST if odds >= math.log(self.s.split_odds) else SLOW if not single else UNSURE
        return ""

    def _odds(self, test: _Test, level: float, sigma: float) -> float:
        """Log-odds, from the mean of the test's timings, of "healthy" (log busbw about `level`)
        over "`slow_factor` slower". The mean's variance is the timings' own (sigma^2 / k) plus
        the level's, a median of n reference timings (pi/2 sigma^2 / n): a level read from
        few timings early in the search asks for more evidence, not less."""
        gap = math.log(self.s.slow_factor)
        mean = statistics.fmean(test.logs) - level
        variance = sigma * sigma * (1 / len(test.logs) + math.pi / 2 / len(self._reference()))
        return gap * (mean + gap / 2) / variance

    def _confirmed(self, test: _Test) -> bool:
        """Timed `confirm` times, beside two different partners at least (where there are two)."""
        return len(test.logs) >= self.s.confirm and (len(set(test.groups)) >= 2 or len(self.cleared) < 2)

    def _split_test(self, test: _Test) -> None:
        known = {frozenset(t.suspects) for t in self._tests if t.verdict != MERGED}
        for part in _split(list(test.suspects), self.s.fanout):
            if frozenset(part) not in known:
                self._tests.append(_Test(part))

    def _slow_sets(self) -> int:
        """Disjoint suspect sets surely slow: each holds a slow node."""
        slow = sorted((t.suspects for t in self._tests if t.verdict == SLOW and (t.sure or len(t.suspects) == 1)), key=len)
        used: set[str] = set()
        count = 0
        for suspects in slow:
            if not used & set(suspects):
                used |= set(suspects)
                count += 1
        return count

    def _pending(self) -> list[_Test]:
        """Tests still to decide; until the whole screen is timed once, only its untimed tests."""
        if not self._screened:
            return [t for t in self._tests if not t.logs]
        return [t for t in self._tests if not t.verdict]

    # -- the healthy level and the noise

    def _reference(self) -> list[float]:
        """What healthy nodes carry: the reference as last weighed (`_weigh_reference`)."""
        return self._ref or self._base_reference()

    def _base_reference(self) -> list[float]:
        """Every control (a group of cleared nodes), and until there are enough of them the
        screen's timings less those of the groups that may hold a slow node (the `max_slow`
        groups, or pairs touching them, slowest on average): trimmed of its lowest, the screen
        lifts the level a little, less the more each group was timed."""
        controls = [log for _, log in self._controls]
        if len(controls) >= ENOUGH_CONTROLS:
            return controls
        screen = sorted(self._tests[:self._screen_size], key=lambda t: statistics.fmean(t.logs), reverse=True)
        kept = screen[:max(1, len(screen) - self._spoilable)]
        return [x for t in kept for x in t.logs] + controls

    def _weigh_reference(self) -> None:
        """The reference, widened to every timing of every test that leans healthy against the
        level so far (odds >= 0). A test cleared early is one that timed fast, and would lift
        the level alone; a test still timed is a fresh draw each round, and leaning healthy
        leaves out only the slow draws, most of them a slow node's. Few nodes give few
        controls, so without this a level read high from a lucky screen would never come down."""
        self._ref = []
        level, sigma = self._level(), self._sigma()
        leaning = [x for t in self._tests if t.logs and t.verdict not in (SLOW, UNSURE)
                   and self._odds(t, level, sigma) >= 0 for x in t.logs]
        self._ref = self._base_reference() + leaning

    def _level(self) -> float:
        return statistics.median(self._reference())

    def _sigma(self) -> float:
        """The noise (sd of a timing's log), pooled: each test's timings about their mean, and the
        controls about the level, behind a prior worth `prior_weight` deviations. Not the screen's
        timings: trimmed of their lowest, they spread less than timings do."""
        square = self.s.prior_weight * self.s.prior_sigma ** 2
        weight = float(self.s.prior_weight)
        for test in self._tests:
            if len(test.logs) > 1:
                mean = statistics.fmean(test.logs)
                square += sum((x - mean) ** 2 for x in test.logs)
                weight += len(test.logs) - 1
        level = self._level()
        square += sum((log - level) ** 2 for _, log in self._controls)
        weight += len(self._controls)
        return max(math.sqrt(square / weight), 0.01)

    # -- planning

    def _group_for(self, test: _Test, busy: set[str]) -> Group:
        """The test's suspects, with a cleared partner when it is a single node (a new partner
        each time where there is one); empty when a node it needs is busy this round."""
        if busy & set(test.suspects):
            return ()
        if len(test.suspects) > 1:
            return test.suspects
        had = {n for g in test.groups for n in g}
        free = [n for n in self.nodes if n in self.cleared and n not in busy]
        fresh = [n for n in free if n not in had]
        pick = fresh or free
        return (test.suspects[0], pick[0]) if pick else ()

    def _evidence(self, test: _Test, level: float) -> NodeEvidence:
        return NodeEvidence(node=test.suspects[0], busbw=[math.exp(x) for x in test.logs],
                            groups=list(test.groups), healthy_busbw=level)


def _split(nodes: list[str], parts: int) -> list[Group]:
    """Nodes in `parts` contiguous groups as even as can be (at least 1 node each)."""
    parts = max(1, min(parts, len(nodes)))
    size, extra = divmod(len(nodes), parts)
    out: list[Group] = []
    start = 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(nodes[start:end]))
        start = end
    return out


def _all_pairs(nodes: list[str]) -> list[Group]:
    """Every pair, in round-robin order (the circle method): each run of n/2 pairs is disjoint,
    so the planner's greedy packing times them in n-1 rounds (n for odd n)."""
    ring: list[Optional[str]] = list(nodes) + ([None] if len(nodes) % 2 else [])
    n = len(ring)
    out: list[Group] = []
    for _ in range(n - 1):
        for i in range(n // 2):
            a, b = ring[i], ring[n - 1 - i]
            if a is not None and b is not None:
                out.append((a, b))
        ring = [ring[0], ring[-1]] + ring[1:-1]
    return out


def _pairs_touching(n: int, k: int) -> int:
    """Pairs of n nodes that contain at least one of k given nodes."""
    k = min(k, n)
    return n * (n - 1) // 2 - (n - k) * (n - k - 1) // 2


def run_search(nodes: Sequence[str], time_round: Callable[[list[Group]], Sequence[float]],
               settings: SearchSettings = SearchSettings()) -> SearchResult:
    """Drive a search to its end: `time_round` times one round's groups at once, busbw each."""
    search = NodeSearch(nodes, settings)
    while True:
        groups = search.plan()
        if not groups:
            return search.result()
        search.record(time_round(groups))


def model_busbw(groups: Sequence[Group], speed: Callable[[str], float], sigma: float,
                gauss: Callable[[float, float], float]) -> list[float]:
    """The timing model the search is tested against: a group's busbw is its slowest member's
    speed (a ring is as fast as its slowest link), times lognormal noise of `sigma` (the sd of
    its logarithm), drawn afresh for every timing. `gauss` is random.Random(seed).gauss."""
    return [min(speed(n) for n in g) * math.exp(gauss(0.0, sigma)) for g in groups]


def replay(nodes: Sequence[str], rounds: Sequence[tuple[Sequence[Group], Sequence[float]]],
           settings: SearchSettings = SearchSettings()) -> SearchResult:
    """The verdict of a search from its recorded rounds (each round's groups and their busbw),
    as the ranks reached it: the planner is deterministic, so the diagnosis judges what was
    measured without the ranks. A round that is not the one the planner asks for next means
    the record is from another planner (or damaged): ValueError."""
    search = NodeSearch(nodes, settings)
    for groups, figures in rounds:
        if [tuple(g) for g in groups] != search.plan():
            raise ValueError(f"round {search.rounds + 1} of the record is not the one this search plans")
        search.record(figures)
    return search.result()

"""ddpdoctor.runtime.inject: the --inject / DDPDOCTOR_INJECT grammar, parsed without starting a rank."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.faults import (_KEYS, FAULT_STAGES, PROBE_STAGE_PREFIX, STAGES, Fault, check_ranks,
                                   check_standalone, parse_faults)
from ddpdoctor.runtime.inject import Injector

FAST = settings(database=None, deadline=None, max_examples=200,
                suppress_health_check=[HealthCheck.too_slow])


def _usage_error(spec: str) -> str:
    with pytest.raises(UsageError) as info:
        parse_faults(spec)
    message = str(info.value)
    assert "\n" not in message and len(message.splitlines()) == 1, message
    return message


# -- valid specs ---------------------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    ("slow:rank=1:factor=2", Fault("slow", 1, factor=2.0)),
    ("slow:rank=0:factor=1", Fault("slow", 0, factor=1.0)),
    ("slow:rank=3:factor=1000", Fault("slow", 3, factor=1000.0)),
    ("slow:rank=2:factor=2.5", Fault("slow", 2, factor=2.5)),
    ("hang:rank=0:stage=train", Fault("hang", 0, stage="train")),
    ("crash:rank=1:stage=init", Fault("crash", 1, stage="init")),
    ("diverge:rank=1", Fault("diverge", 1)),
    # key order does not matter
    ("crash:stage=verify:rank=7", Fault("crash", 7, stage="verify")),
    ("slow:factor=3:rank=4", Fault("slow", 4, factor=3.0)),
    ("slowdata:rank=2:ms=20", Fault("slowdata", 2, ms=20.0)),
    ("slowdata:ms=0.5:rank=0", Fault("slowdata", 0, ms=0.5)),
    ("bigbatch:rank=1:factor=2", Fault("bigbatch", 1, factor=2.0)),
])
def test_one_valid_fault(spec, expected):
    assert parse_faults(spec) == (expected,)


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_is_accepted_for_hang_and_crash(stage):
    assert parse_faults(f"hang:rank=0:stage={stage},crash:rank=1:stage={stage}") == (
        Fault("hang", 0, stage=stage), Fault("crash", 1, stage=stage))


def test_several_faults_keep_their_order():
    faults = parse_faults("crash:rank=1:stage=train,slow:rank=0:factor=4,diverge:rank=2,hang:rank=3:stage=ddp")
    assert [f.kind for f in faults] == ["crash", "slow", "diverge", "hang"]
    assert [f.rank for f in faults] == [1, 0, 2, 3]
    assert faults[1].factor == 4.0 and faults[1].stage is None
    assert faults[0].stage == "train" and faults[0].factor is None


def test_whitespace_and_case_around_parts_are_ignored():
    faults = parse_faults("  SLOW : Rank = 1 : factor = 2 ,  hang:rank=0:stage= train  , ")
    assert faults == (Fault("slow", 1, factor=2.0), Fault("hang", 0, stage="train"))


@pytest.mark.parametrize("spec", [None, "", "   ", ",", " , ,, "])
def test_no_spec_means_no_faults(spec):
    assert parse_faults(spec) == ()


def test_to_json_leaves_out_unset_fields():
    assert Fault("diverge", 2).to_json() == {"kind": "diverge", "rank": 2}
    assert Fault("slow", 1, factor=2.0).to_json() == {"kind": "slow", "rank": 1, "factor": 2.0}


# -- every error path: UsageError, one line, naming the bad part -------------------

def test_unknown_kind_is_named():
    message = _usage_error("explode:rank=1")
    assert "unknown fault kind 'explode'" in message
    assert "slow:rank=1:factor=2" in message  # the help says what would be valid


def test_unknown_kind_in_second_item_is_named():
    message = _usage_error("crash:rank=1:stage=init,freeze:rank=0")
    assert "'freeze'" in message
    assert "freeze:rank=0" in message


def test_unknown_stage_is_named():
    message = _usage_error("hang:rank=0:stage=forward")
    assert "unknown stage 'forward'" in message
    assert "train" in message  # lists the valid stages


@pytest.mark.parametrize("spec, missing", [
    ("crash:stage=init", "rank"),
    ("slow:factor=2", "rank"),
    ("diverge", "rank"),
    ("hang:rank=1", "stage"),
    ("slow:rank=1", "factor"),
])
def test_missing_key_is_named(spec, missing):
    message = _usage_error(spec)
    assert f"needs {missing}" in message
    assert repr(spec) in message


@pytest.mark.parametrize("factor", ["0.5", "0", "-2", "1000.5", "1e6", "nan", "inf", "-inf"])
def test_factor_out_of_range(factor):
    message = _usage_error(f"slow:rank=1:factor={factor}")
    assert "factor must be between 1 and 1000" in message
    assert f"factor={factor}" in message


@pytest.mark.parametrize("ms", ["-1", "60001", "nan", "inf", "slow", ""])
def test_stall_out_of_range_or_not_a_number(ms):
    message = _usage_error(f"slowdata:rank=1:ms={ms}")
    assert "ms must be" in message and f"ms={ms}" in message


def test_injected_stall_and_batch_reach_only_their_rank():
    faults = parse_faults("slowdata:rank=1:ms=25,bigbatch:rank=2:factor=1.5")
    assert Injector(faults, 1).data_delay_s() == 0.025 and Injector(faults, 1).batch_factor() == 1.0
    assert Injector(faults, 2).data_delay_s() == 0.0 and Injector(faults, 2).batch_factor() == 1.5
    assert [f.describe() for f in faults] == ["slowdata:rank=1:ms=25", "bigbatch:rank=2:factor=1.5"]


def test_factor_not_a_number():
    message = _usage_error("slow:rank=1:factor=fast")
    assert "factor must be a number" in message
    assert "factor=fast" in message


@pytest.mark.parametrize("rank", ["x", "1.5", "", "one", "0x1"])
def test_non_integer_rank(rank):
    message = _usage_error(f"crash:rank={rank}:stage=init")
    assert "rank must be an integer" in message
    assert f"rank={rank}" in message


def test_negative_rank():
    message = _usage_error("diverge:rank=-1")
    assert "rank must be >= 0" in message
    assert "rank=-1" in message


@pytest.mark.parametrize("spec, bad", [
    ("crash:rank=1:when=init", "when=init"),       # key that no fault has
    ("diverge:rank=1:stage=train", "stage=train"),  # key another fault has
    ("slow:rank=1:factor=2:stage=init", "stage=init"),
    ("crash:rank=1:stage", "stage"),                # no '='
    ("crash:rank=1:stage=init:", ""),               # trailing ':'
])
def test_bad_key_is_named(spec, bad):
    message = _usage_error(spec)
    assert f"bad option {bad!r}" in message


def test_newline_in_spec_is_escaped_in_the_message():
    message = _usage_error("crash:rank=x\n1:stage=init")
    assert "x\\n1" in message


# -- check_ranks ---------------------------------------------------------------

def test_check_ranks_accepts_ranks_below_world_size():
    check_ranks(parse_faults("crash:rank=0:stage=init,slow:rank=3:factor=2"), 4)  # must not raise


@pytest.mark.parametrize("rank, world", [(2, 2), (4, 4), (9, 1)])
def test_check_ranks_rejects_rank_at_or_above_world_size(rank, world):
    faults = parse_faults(f"slow:rank=0:factor=2,crash:rank={rank}:stage=train")
    with pytest.raises(UsageError) as info:
        check_ranks(faults, world)
    message = str(info.value)
    assert "\n" not in message
    assert f"crash:rank={rank}:stage=train" in message
    assert f"only {world} ranks (0-{world - 1})" in message


# -- describe round-trips ----------------------------------------------------------

@pytest.mark.parametrize("fault", [
    Fault("slow", 1, factor=2.0), Fault("slow", 0, factor=1.5), Fault("slow", 12, factor=1000.0),
    Fault("hang", 0, stage="train"), Fault("crash", 5, stage="rendezvous"), Fault("diverge", 3),
])
def test_describe_round_trips(fault):
    assert fault.describe().count(":") >= 1
    assert parse_faults(fault.describe()) == (fault,)


_FACTORS = st.one_of(st.integers(1, 1000).map(float),
                     st.integers(10, 9999).map(lambda n: n / 10))  # at most 5 significant digits


@st.composite
def faults(draw):
    kind = draw(st.sampled_from(["slow", "hang", "crash", "kill", "oom", "sigint", "sigterm", "diverge"]))
    rank = draw(st.integers(0, 100_000))
    if kind == "slow":
        return Fault(kind, rank, factor=draw(_FACTORS))
    if kind != "diverge":
        return Fault(kind, rank, stage=draw(st.sampled_from(FAULT_STAGES + ("probe:topology", "probe:ddp-smoke"))))
    return Fault(kind, rank)


@settings(FAST, max_examples=100)
@given(st.lists(faults(), min_size=1, max_size=4))
def test_describe_round_trips_for_any_list(items):
    spec = ",".join(f.describe() for f in items)
    assert parse_faults(spec) == tuple(items)


def test_describe_keeps_full_factor_precision():
    fault = parse_faults("slow:rank=1:factor=1.0000001")[0]
    assert parse_faults(fault.describe()) == (fault,)


# -- fuzz: any text parses or is a one-line UsageError -------------------------------

_GRAMMARISH = st.text(alphabet=st.sampled_from(list("slowhangcrashdivergerankstagefactortrain=:,. -019\n\t")),
                      max_size=60)


def _parses_or_usage_error(text: str) -> None:
    try:
        result = parse_faults(text)
    except UsageError as exc:
        message = str(exc)
        assert message and "\n" not in message and "\r" not in message
        assert len(message.splitlines()) == 1
    else:
        assert isinstance(result, tuple)
        for fault in result:
            # Whatever the parser accepts is a fault the runtime knows: one of its kinds, a real
            # stage (or a probe's), a factor in range, the other end of a link only for a link.
            assert fault.kind in _KEYS
            assert fault.rank >= 0
            assert fault.stage is None or fault.stage in FAULT_STAGES or fault.stage.startswith(PROBE_STAGE_PREFIX)
            assert fault.stage is None or _KEYS[fault.kind].get("stage")
            assert fault.factor is None or 1.0 <= fault.factor <= 1000.0
            assert (fault.peer is not None) == bool(_KEYS[fault.kind].get("ranks"))


@FAST
@given(st.text(max_size=80))
@example("crash:rank=1\u2028:stage=init")
@example("slow:rank=1:factor=" + "9" * 5000)
@example("crash:rank=" + "1" * 5000 + ":stage=init")
@example("kill:rank=0:stage=init")
@example("oom:rank=0:stage=train")
@example("hang:rank=0:stage=collective")
@example("crash:rank=1:stage=probe:topology")
@example("slowlink:ranks=1,2")
@example("bigbatch:rank=1:factor=2")
def test_any_text_parses_or_raises_one_line_usage_error(text):
    _parses_or_usage_error(text)


@FAST
@given(_GRAMMARISH)
def test_grammar_like_text_parses_or_raises_one_line_usage_error(text):
    _parses_or_usage_error(text)


# -- the fault matrix's kinds and stages -------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    ("kill:rank=1:stage=probe:topology", Fault("kill", 1, stage="probe:topology")),
    ("oom:rank=0:stage=launch", Fault("oom", 0, stage="launch")),
    ("SIGINT:Rank=2:Stage=Probe:GPU-Count", Fault("sigint", 2, stage="probe:gpu-count")),
    ("sigterm:rank=1:stage=report,crash:rank=0:stage=probe:init-hang",
     Fault("sigterm", 1, stage="report")),
])
def test_new_kinds_and_probe_stages_parse(spec, expected):
    assert parse_faults(spec)[0] == expected
    assert parse_faults(expected.describe()) == (expected,)


def test_a_probe_stage_names_a_real_probe():
    with pytest.raises(UsageError, match="unknown probe 'topo' in stage 'probe:topo'.*choose from init-hang"):
        parse_faults("crash:rank=1:stage=probe:topo")


def test_launcher_signals_need_our_own_launcher():
    faults = parse_faults("sigint:rank=1:stage=init")
    check_standalone(faults, standalone=True)
    with pytest.raises(UsageError, match="signals ddpdoctor's own launcher"):
        check_standalone(faults, standalone=False)
    check_standalone(parse_faults("crash:rank=1:stage=init"), standalone=False)


def test_injected_oom_is_a_real_memory_error_and_leaves_the_rank_able_to_allocate():
    import resource

    from ddpdoctor.runtime.inject import run_out_of_memory

    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(MemoryError):
        run_out_of_memory()
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert len(bytearray(64 << 20)) == 64 << 20  # the cap is gone: 64 MiB allocate again

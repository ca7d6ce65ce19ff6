"""`Doctor`'s arguments are checked where they are given, and its memory does not grow with them.

Proves: every bad argument (every, check_every_s, step_deadline_s, batch_size, json_path, history,
on_hang, the flags, the hooks, tensorboard, the model and the optimizer) is a ValueError at
`Doctor(...)` whose message is one line naming the argument and what to give; `DoctorOptions` and
`checked` (what the Lightning and Hugging Face adapters call at creation) raise the same; a refused
`Doctor` leaves no thread behind; and with a real one-rank gloo group, `every=10**9` checks at
step 1 with a few MB at most while `every=1` sends rows of one fixed length.
"""

from __future__ import annotations

import pathlib
import re
import threading
import tracemalloc

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpdoctor import adapters
from ddpdoctor.callback import doctor as doctor_module
from ddpdoctor.callback.doctor import WINDOW_CAP, Doctor
from ddpdoctor.callback.options import DoctorOptions, checked
from ddpdoctor.callback.row import packed_length

NAN, INF = float("nan"), float("inf")
WHOLE = r"(whole number )?>= 1"  # what to give for every and batch_size
SECONDS = r"finite number of seconds"
FLAG = r"must be True or False"
FUNCTION = r"must be a function \(or None\)"


class _Writer:
    """A SummaryWriter as the callback uses one."""

    def add_scalar(self, tag, value, step):
        pass


def _bad_options(tmp_path):
    """(keyword arguments, the argument named, what the message says to give)."""
    missing = str(tmp_path / "no_such_folder" / "f.json")
    return [
        *[({"every": v}, "every", WHOLE) for v in (0, -5, 2.5, "50", True, None)],
        *[({"check_every_s": v}, "check_every_s", SECONDS + " >= 0") for v in (-1, NAN, INF, "2")],
        *[({"step_deadline_s": v}, "step_deadline_s", SECONDS + " above 0") for v in (0, -1, NAN, INF)],
        ({"step_deadline_s": "600"}, "step_deadline_s", r"a number of seconds"),
        *[({"batch_size": v}, "batch_size", WHOLE) for v in (0, -3, 2.5)],
        *[({name: missing}, name, r"folder .* does not exist; create it first") for name in ("json_path", "history")],
        *[({name: str(tmp_path)}, name, r"is a folder: give a file in it") for name in ("json_path", "history")],
        *[({name: ""}, name, r"must be a file path") for name in ("json_path", "history")],
        # A trailing slash names a folder, even one that does not exist yet.
        *[({name: str(tmp_path / "no_such_folder") + "/"}, name, r"is a folder: give a file in it")
          for name in ("json_path", "history")],
        ({"on_hang": "ignore"}, "on_hang", r"must be 'report' or 'exit'"),
        ({"raise_on_finding": "yes"}, "raise_on_finding", FLAG),
        ({"measure_comm": 1}, "measure_comm", FLAG),
        ({"on_finding": 5}, "on_finding", FUNCTION),
        ({"on_metrics": "x"}, "on_metrics", FUNCTION),
        ({"tensorboard": 5}, "tensorboard", r"must be a log folder or a SummaryWriter"),
        ({"tensorboard": ""}, "tensorboard", r"must be a log folder or a SummaryWriter"),
    ]


def _case_id(kwargs: dict) -> str:
    name, value = next(iter(kwargs.items()))
    shown = repr(value)
    for path, label in (("/t/no_such_folder/f.json", "<in a missing folder>"), ("/t/no_such_folder/", "<a missing folder/>"),
                        ("/t", "<a folder>")):
        shown = shown.replace(repr(path), label)
    return f"{name}={shown}"


BAD_NAMES = [_case_id(kw) for kw, _, _ in _bad_options(pathlib.Path("/t"))]


def _assert_one_line(error: BaseException, name: str, give: str) -> None:
    message = str(error)
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith(name + " "), message  # the argument first
    assert re.search(give, message), message


def _our_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("ddpdoctor")}


@pytest.mark.parametrize("case", range(len(BAD_NAMES)), ids=BAD_NAMES)
def test_a_bad_argument_is_one_line_naming_it_and_what_to_give(tmp_path, case):
    kwargs, name, give = _bad_options(tmp_path)[case]
    with pytest.raises(ValueError) as options_error:
        DoctorOptions(**kwargs)
    _assert_one_line(options_error.value, name, give)
    before = _our_threads()
    with pytest.raises(ValueError, match=re.escape(str(options_error.value))) as doctor_error:
        Doctor(nn.Linear(2, 2), **kwargs)
    _assert_one_line(doctor_error.value, name, give)
    # Nothing was started for a Doctor that refused its arguments (no watchdog left to run forever).
    assert _our_threads() - before == set()
    with pytest.raises(ValueError, match=re.escape(str(options_error.value))):
        checked(kwargs)  # what lightning_callback and hf_callback call at creation


@pytest.mark.parametrize("objects, name, give", [
    ({"model": object()}, "model", r"must be a torch\.nn\.Module"),
    ({"model": nn.Linear(2, 2), "optimizer": object()}, "optimizer", r"must be a torch\.optim\.Optimizer"),
], ids=["model=object()", "optimizer=object()"])
def test_the_jobs_objects_are_checked_before_anything_starts(objects, name, give):
    before = _our_threads()
    with pytest.raises(ValueError, match=name) as error:
        Doctor(**objects)
    _assert_one_line(error.value, name, give)
    assert _our_threads() - before == set()


@pytest.mark.parametrize("kwargs", [
    {"every": 1}, {"every": 10**9}, {"check_every_s": 0}, {"check_every_s": 0.5}, {"batch_size": None},
    {"batch_size": 8}, {"tensorboard": _Writer()}, {"on_hang": "exit"}, {"step_deadline_s": 0.5},
], ids=lambda kw: "{}={!r}".format(*next(iter(kw.items()))))
def test_good_arguments_are_taken_as_given(kwargs):
    doctor = Doctor(nn.Linear(2, 2), optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), **kwargs)
    try:
        for name, value in kwargs.items():
            assert getattr(doctor.options, name) == value
    finally:
        doctor.close()


@pytest.mark.parametrize("name", ["json_path", "history"])
@pytest.mark.parametrize("as_path", [False, True], ids=["str", "pathlib.Path"])
def test_a_file_in_an_existing_folder_is_taken_as_a_string(tmp_path, name, as_path):
    path = tmp_path / "out.file"
    doctor = Doctor(nn.Linear(2, 2), **{name: path if as_path else str(path)})
    try:
        assert getattr(doctor.options, name) == str(path)
        assert getattr(doctor, name) == str(path)
    finally:
        doctor.close()


def test_an_unknown_name_lists_the_accepted_ones():
    with pytest.raises(ValueError) as error:
        checked({"evry": 5})
    message = str(error.value)
    assert "\n" not in message and "'evry'" in message
    assert all(name in message for name in (*DoctorOptions.names(), "optimizer", "loader", "sampler"))
    assert checked({"every": 5, "optimizer": None}).every == 5


@pytest.mark.adapters
def test_the_lightning_adapter_refuses_at_creation():
    pytest.importorskip("lightning")
    with pytest.raises(ValueError, match=r"^every must be >= 1, not 0$"):
        adapters.lightning_callback(every=0)
    with pytest.raises(ValueError, match=r"'evry'"):
        adapters.lightning_callback(evry=5)
    assert adapters.lightning_callback(every=5) is not None


@pytest.mark.adapters
def test_the_hf_adapter_refuses_at_creation():
    # Refused before transformers is imported: the same check wherever it is installed.
    with pytest.raises(ValueError, match=r"^every must be >= 1, not 0$"):
        adapters.hf_callback(every=0)
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"'evry'"):
        adapters.hf_callback(evry=5)
    assert adapters.hf_callback(every=5) is not None


def test_a_loader_the_adapter_accepts_reaches_the_doctor(monkeypatch):
    import sys
    import types
    from types import SimpleNamespace

    for dotted in ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks"):
        monkeypatch.setitem(sys.modules, dotted, types.ModuleType(dotted))
    sys.modules["lightning.pytorch.callbacks"].Callback = object
    mine = [torch.zeros(2)]
    callback = adapters.lightning_callback(loader=mine)  # accepted by checked()
    model = nn.Linear(2, 2)
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=model), optimizers=[], train_dataloader=None)
    callback.on_train_start(trainer, model)
    try:
        assert callback.doctor.loader is mine
    finally:
        callback.doctor.close()


@pytest.fixture
def gloo(tmp_path, monkeypatch):
    """A real world of one on gloo, where a row sized beyond WINDOW_CAP fails before it is built."""
    real_pack = doctor_module.pack

    def pack(row, width):
        # A regression to a row sized by `every` must fail here, not allocate gigabytes first.
        assert width <= WINDOW_CAP, f"a row {width} steps wide"
        return real_pack(row, width)

    monkeypatch.setattr(doctor_module, "pack", pack)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sent_lengths(doctor, monkeypatch) -> list[int]:
    """The length of every packed row the doctor sends, recorded on the way to the real gather."""
    sent: list[int] = []
    real_exchange = doctor._gather.exchange

    def exchange(values):
        sent.append(len(values))
        return real_exchange(values)

    monkeypatch.setattr(doctor._gather, "exchange", exchange)
    return sent


def _steps(doctor, count: int) -> None:
    for _ in range(count):
        with doctor.step(torch.zeros(3, 4)):
            pass


def test_a_huge_every_checks_at_step_one_in_bounded_memory(gloo, monkeypatch):
    warm = Doctor(nn.Linear(4, 2), every=1, check_every_s=0)  # the check's lazy imports, outside the trace
    try:
        _steps(warm, 2)
    finally:
        warm.close()
    doctor = Doctor(nn.Linear(4, 2), every=10**9, check_every_s=0)
    try:
        sent = _sent_lengths(doctor, monkeypatch)
        tracemalloc.start()
        try:
            _steps(doctor, 300)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MB traced over 300 steps"  # about 30 KB here
        assert sent == [packed_length(WINDOW_CAP)]  # step 1 was checked, and only step 1
        assert doctor._next_check >= 10**9 and doctor._next_check % 10**9 == 0
        assert len(doctor._step_ms) <= WINDOW_CAP and len(doctor._samples) <= WINDOW_CAP
    finally:
        doctor.close()


def test_checking_every_step_sends_rows_of_one_length(gloo, monkeypatch):
    doctor = Doctor(nn.Linear(4, 2), every=1, check_every_s=0)
    try:
        sent = _sent_lengths(doctor, monkeypatch)
        _steps(doctor, 300)
        assert len(sent) == 300 and set(sent) == {packed_length(WINDOW_CAP)}
        assert doctor._next_check == 301
    finally:
        doctor.close()


def test_a_history_store_from_the_environment_is_checked_too(tmp_path, monkeypatch):
    """DDPDOCTOR_HISTORY stands for `history=`: a store in a missing folder is refused at once, not at close."""
    monkeypatch.setenv("DDPDOCTOR_HISTORY", str(tmp_path / "no_such_folder" / "h.db"))
    before = _our_threads()
    with pytest.raises(ValueError) as caught:
        Doctor(nn.Linear(2, 2))
    _assert_one_line(caught.value, "DDPDOCTOR_HISTORY", r"does not exist; create it first")
    # No thread of its own (as the tests above say it): a thread of an earlier test's closed Doctor may still
    # be ending, which `==` took for this one's (failed once, beside a 4-rank benchmark on the same cores).
    assert _our_threads() - before == set()

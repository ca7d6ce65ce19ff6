"""`ddpdoctor run`'s own parts, without ranks: the command line split, the script run as Python runs it (its
argv, path, __name__, exit status, traceback), the settings carried through the environment, the import hook,
the sitecustomize that carries them into child processes, and the one line where nothing was attached.

The ranks' side (faults named in every launch style) is tests/ranks/test_run_command_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ddpdoctor.attach import command, script
from ddpdoctor.attach.import_hooks import when_imported
from ddpdoctor.attach.settings import DIR_VAR, RUN_VAR, SITE_DIR, RunSettings
from ddpdoctor.core.errors import UsageError

TAKES = {"--json", "--every", "--check-every-s"}


def ddpdoctor_run(*args: str, cwd: Path, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (RUN_VAR, DIR_VAR, "RANK", "SLURM_PROCID")}
    return subprocess.run([sys.executable, "-m", "ddpdoctor", "run", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_options_come_first_then_the_script_and_everything_after_it_is_the_scripts():
    s = command.split(["--json", "r.json", "--every=5", "train.py", "--json", "theirs", "-m", "x"], TAKES)
    assert s.options == ["--json", "r.json", "--every=5"]
    assert s.target == script.Target(path="train.py", args=("--json", "theirs", "-m", "x")) and s.command is None
    m = command.split(["--every", "3", "-m", "pkg.train", "--lr", "1"], TAKES)
    assert m.target == script.Target(module="pkg.train", args=("--lr", "1"))
    assert command.split(["-mpkg.train"], TAKES).target == script.Target(module="pkg.train")
    c = command.split(["--json", "x", "--", "torchrun", "--nproc_per_node=2", "train.py"], TAKES)
    assert c.command == ["torchrun", "--nproc_per_node=2", "train.py"] and c.target is None
    for bad in (["--"], ["-m"], ["--json"]):
        with pytest.raises(UsageError):
            command.split(bad, TAKES)


def test_the_settings_travel_in_the_environment_with_the_site_folder_first_on_pythonpath_once():
    settings = RunSettings(options={"every": 5, "json_path": "/x/r.json"}, run_dir="/tmp/d")
    env = settings.environment({"PYTHONPATH": f"/theirs{os.pathsep}{SITE_DIR}"})
    assert env["PYTHONPATH"].split(os.pathsep) == [SITE_DIR, "/theirs"]
    assert RunSettings.from_environment(env) == settings
    assert RunSettings.from_environment({}) is None and RunSettings.from_environment({RUN_VAR: "[1]"}) is None


def test_exit_statuses_are_the_interpreters():
    assert [script.exit_status(c) for c in (None, 0, 3, 256, -1)] == [0, 0, 3, 0, 255]


def test_a_script_runs_as_python_runs_it_and_its_status_and_traceback_are_its_own(tmp_path, capsys):
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import json, sys
        from helper_mod import VALUE
        def fn():
            pass
        seen = {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "value": VALUE,
                "main_is_me": sys.modules["__main__"].__dict__.get("fn") is fn}
        json.dump(seen, open(sys.argv[1], "w"))
        if sys.argv[2] == "exit":
            sys.exit(4)
        if sys.argv[2] == "raise":
            def deeper():
                raise ValueError("the script's own")
            deeper()
    """))
    out = tmp_path / "seen.json"
    target = script.Target(path=str(tmp_path / "train.py"), args=(str(out), "exit"))
    assert script.run(target) == 4
    seen = json.loads(out.read_text())
    assert seen == {"name": "__main__", "argv": [str(tmp_path / "train.py"), str(out), "exit"], "path0": str(tmp_path),
                    "value": 7, "main_is_me": True}
    saved = list(sys.argv)
    assert script.run(script.Target(path=str(tmp_path / "train.py"), args=(str(out), "raise"))) == 1
    err = capsys.readouterr().err
    first = err.splitlines()[1]  # the first frame under "Traceback (most recent call last):" is the script's
    assert "train.py" in first and "runpy" not in err and "ddpdoctor" not in err, err
    assert err.rstrip().endswith("ValueError: the script's own") and sys.argv == saved


def test_when_imported_calls_after_the_import_and_at_once_for_a_module_already_there(tmp_path, monkeypatch):
    (tmp_path / "late_mod.py").write_text("READY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[bool] = []
    when_imported("late_mod", lambda m: seen.append(m.READY))
    assert seen == []
    import late_mod  # noqa: F401

    assert seen == [True]
    when_imported("late_mod", lambda m: seen.append(False))
    assert seen == [True, False]
    sys.modules.pop("late_mod", None)


def test_the_sitecustomize_attaches_only_under_run_and_still_runs_the_one_it_hides(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIRS_RAN = True\n")
    probe = ("import builtins, sys; from ddpdoctor.attach import install; "
             "print(getattr(builtins, 'THEIRS_RAN', False), install.current() is not None, 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in (RUN_VAR, DIR_VAR)}
    under = RunSettings(options={"every": 5}).environment({**env, "PYTHONPATH": str(theirs)})
    out = subprocess.run([sys.executable, "-c", probe], env=under, capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["True", "True", "False"], out  # attached, theirs ran, torch not imported for it
    plain = {**env, "PYTHONPATH": os.pathsep.join([SITE_DIR, str(theirs)])}
    out = subprocess.run([sys.executable, "-c", probe], env=plain, capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["True", "False", "False"], out  # not under run: nothing attached


def test_a_script_that_builds_no_ddp_model_ends_with_one_line_and_the_json_all_the_same(tmp_path):
    (tmp_path / "nothing.py").write_text("print('hello from the script')\n")
    report = tmp_path / "r.json"
    out = ddpdoctor_run("--json", str(report), "nothing.py", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout == "hello from the script\n", out
    assert out.stderr.strip().splitlines() == [command.UNATTACHED], out.stderr
    written = json.loads(report.read_text())
    assert written["attached"] is False and written["findings"] == [] and written["exit_status"] == 0


@pytest.mark.parametrize("args, says", [
    (["--every", "0", "train.py"], "--every"),
    (["--json", "/no/such/folder/r.json", "train.py"], "does not exist"),
    (["--on-hang", "never", "train.py"], "--on-hang"),
    (["missing.py"], "script 'missing.py' not found"),
    (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
    (["--", "no-such-launcher-xyz"], "command 'no-such-launcher-xyz' not found"),
    ([], "give the training script"),
])
def test_bad_input_is_one_line_and_exit_3_before_anything_runs(tmp_path, args, says):
    (tmp_path / "train.py").write_text("raise SystemExit('the script must not run')\n")
    out = ddpdoctor_run(*args, cwd=tmp_path)
    assert out.returncode == 3 and len(out.stderr.strip().splitlines()) == 1, out
    assert out.stderr.startswith("ddpdoctor run: error: ") and says in out.stderr and "Traceback" not in out.stderr


def test_help_lists_the_three_ways_and_the_doctors_options(tmp_path):
    out = ddpdoctor_run("--help", cwd=tmp_path)
    assert out.returncode == 0 and "-- COMMAND" in out.stdout and "-m MODULE" in out.stdout and "--on-hang" in out.stdout


def test_a_module_runs_with_the_current_folder_first_on_its_path(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("X = 5\n")
    (pkg / "train.py").write_text(textwrap.dedent("""
        import sys
        from .helper import X
        print(__name__, X, sys.path[0] == __import__('os').getcwd(), sys.argv[1:])
        sys.exit(2)
    """))
    out = ddpdoctor_run("-m", "pkg.train", "--lr", "1", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout.split() == ["__main__", "5", "True", "['--lr',", "'1']"], out


def test_a_launcher_run_around_keeps_its_exit_status(tmp_path):
    out = ddpdoctor_run("--", sys.executable, "-c", "import sys, os; print(os.environ['DDPDOCTOR_RUN']); sys.exit(5)",
                        cwd=tmp_path)
    assert out.returncode == 5 and json.loads(out.stdout) == {}, out


class _FakeDoctor:
    """What the attachment calls on a Doctor, counted; a lock makes it unpicklable, as the real one is."""

    rank, world_size = 0, 1

    def __init__(self, model, optimizer=None, loader=None, **options) -> None:  # type: ignore[no-untyped-def]
        import threading

        self.lock, self.began, self.ended, self.closers = threading.Lock(), [], 0, []

    @property
    def in_step(self) -> bool:
        return len(self.began) > self.ended

    @property
    def steps_done(self) -> int:
        return self.ended

    def step_begin(self, batch=None) -> None:  # type: ignore[no-untyped-def]
        self.began.append(batch)

    def step_end(self, loss=None) -> None:  # type: ignore[no-untyped-def]
        self.ended += int(self.in_step)  # as the Doctor's: nothing outside a step

    def before_close(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.closers.append(fn)

    def tell(self, found) -> None:  # type: ignore[no-untyped-def]
        pass


def test_once_attached_two_lean_hooks_replace_the_looking_ones_and_copies_carry_nothing_of_ours(monkeypatch):
    """The per-step cost of `run` is the explicit Doctor's plus torch's hook calls: once the Doctor attaches, the
    model's looking hook and the global optimizer hook (called at every optimizer's step) are gone, a second
    optimizer's step reaches nothing of ours, and an EMA's deepcopy or a pickle of the model holds no Doctor."""
    import copy
    import pickle

    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import _global_optimizer_post_hooks, register_optimizer_step_post_hook

    from ddpdoctor.attach.step_hooks import LOSS_LOOK_STEPS, Attacher

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    attacher = Attacher(RunSettings(options={}), _FakeDoctor)
    attacher._global_hook = register_optimizer_step_post_hook(attacher._after_optimizer_step)
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    opt, other_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    try:
        attacher.optimizer_built(opt)
        attacher.built(model)
        before = len(_global_optimizer_post_hooks)
        x = torch.randn(3, 4)
        model(x).sum().backward()  # the first training forward attaches, and begins the step
        doctor = attacher.doctor
        assert isinstance(doctor, _FakeDoctor) and len(doctor.began) == 1 and doctor.began[0][0] is x
        assert len(_global_optimizer_post_hooks) == before - 1  # the global hook gave way
        assert [type(h).__name__ for h in model._forward_pre_hooks.values()] == ["_BeginStep"]
        model(x).sum().backward()  # gradient accumulation: a second forward, the same step
        other_opt.step()  # another optimizer: nothing of ours runs
        assert len(doctor.began) == 1 and doctor.ended == 0
        opt.step()
        assert doctor.ended == 1 and not doctor.in_step
        opt.step()  # a second step with no forward before it ends nothing
        assert doctor.ended == 1
        model.eval()
        model(x)  # evaluation's forward begins no step
        assert len(doctor.began) == 1
        model.train()

        for _ in range(LOSS_LOOK_STEPS):  # a plain loop: the model returns no loss, its hook is let go
            model(x).sum().backward()
            opt.step()
        assert doctor.ended == 1 + LOSS_LOOK_STEPS == len(doctor.began) and not model._forward_hooks
        (end,) = opt._optimizer_step_post_hooks.values()
        assert end.tap is None  # the step's end alone from here

        ema = copy.deepcopy(model)
        ema(x)  # the copy's hook is inert: no step begins
        assert len(doctor.began) == 1 + LOSS_LOOK_STEPS
        assert b"_FakeDoctor" not in pickle.dumps(model)  # torch.save(model) carries nothing of ours

        for close in doctor.closers:
            close()
        assert attacher.doctor is None and len(_global_optimizer_post_hooks) == before  # looking again
        assert not model._forward_pre_hooks and not opt._optimizer_step_post_hooks
    finally:
        if attacher._global_hook is not None:
            attacher._global_hook.remove()


def test_a_watched_ddp_model_keeps_modules_fast_path_its_step_begun_from_ddps_own_pre_forward(tmp_path):
    """A DDP model's step begins from DDP's `_pre_forward` (wrapped once at the class), not from a forward
    pre-hook that would take each forward off `Module.__call__`'s fast path: once attached the watched model
    has no hook of ours, another DDP model's forward begins nothing, a deepcopy or a pickle carries nothing of
    ours, and at the close nothing is left to call."""
    import copy
    import pickle

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ddpdoctor.attach import step_hooks
    from ddpdoctor.attach.step_hooks import LOSS_LOOK_STEPS, Attacher

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    attacher = Attacher(RunSettings(options={}), _FakeDoctor)
    attacher._global_hook = register_optimizer_step_post_hook(attacher._after_optimizer_step)
    attacher._pre_forward = step_hooks._wrap_pre_forward(DistributedDataParallel)
    try:
        assert attacher._pre_forward is not None and DistributedDataParallel._pre_forward is attacher._pre_forward
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        other = DistributedDataParallel(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        attacher.optimizer_built(opt)
        attacher.built(model)
        x = torch.randn(3, 4)
        for _ in range(LOSS_LOOK_STEPS + 1):  # the first attaches; the loss hook looks, then is let go
            model(x).sum().backward()
            opt.step()
        doctor = attacher.doctor
        assert isinstance(doctor, _FakeDoctor) and doctor.ended == len(doctor.began) == LOSS_LOOK_STEPS + 1
        assert doctor.began[-1][0] is x  # the forward's inputs are the step's batch
        assert not model._forward_pre_hooks and not model._forward_hooks  # Module.__call__'s fast path
        other(x)  # another DDP model: nothing begins
        model.eval()
        model(x)  # evaluation begins no step
        model.train()
        assert len(doctor.began) == LOSS_LOOK_STEPS + 1
        clone = copy.deepcopy(model)
        clone(x)
        assert len(doctor.began) == LOSS_LOOK_STEPS + 1 and b"ddpdoctor" not in pickle.dumps(model.module)
        for close in doctor.closers:
            close()
        assert not step_hooks._BEGINS  # the close took the entry
        model(x)
        assert len(doctor.began) == LOSS_LOOK_STEPS + 1
    finally:
        if attacher._global_hook is not None:
            attacher._global_hook.remove()
        step_hooks._BEGINS.clear()
        if attacher._pre_forward is not None:  # the class as it was, for the tests after this one
            DistributedDataParallel._pre_forward = attacher._pre_forward.__wrapped__
        dist.destroy_process_group()

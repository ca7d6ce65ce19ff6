"""`--model` and `--batch`: every wrong path or shape is one line and exit 3, before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpdoctor import cli
from ddpdoctor.core.findings import EXIT_UNKNOWN
from ddpdoctor.runtime.user_model import ModelSpec, validate

TINY = str(Path(__file__).resolve().parents[1] / "ranks" / "tiny_model.py")


@pytest.fixture(autouse=True)
def standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("args, words", [
    (["--model", "no_such_module_here:f", "--batch", f"{TINY}:make_batch"], "cannot import 'no_such_module_here'"),
    (["--model", f"{TINY}:make_model"], "--model and --batch go together"),
    (["--model", f"{TINY}:not_a_model", "--batch", f"{TINY}:make_batch"], "returned a value of type str"),
    (["--model", f"{TINY}:make_model", "--batch", f"{TINY}:wrong_batch"], "returned one tensor of shape (2, 5)"),
    (["--model", f"{TINY}:nope", "--batch", f"{TINY}:make_batch"], "has no 'nope'"),
    (["--model", "missing/file.py:f", "--batch", f"{TINY}:make_batch"], "no such file missing/file.py"),
    (["--model", f"{TINY}:CLASSES", "--batch", f"{TINY}:make_batch"], "CLASSES is a value of type int"),
    (["--model", "text-without-colon", "--batch", f"{TINY}:make_batch"], "give module:function"),
])
@pytest.mark.parametrize("command", ["check", "scaling"])
def test_a_wrong_model_or_batch_is_one_line_and_exit_3(capsys, command, args, words) -> None:
    assert cli.main([command, *args]) == EXIT_UNKNOWN
    err = capsys.readouterr().err
    assert err.startswith("ddpdoctor: error: ") and words in err and err.count("\n") == 1, err


def test_a_model_that_fails_on_the_batch_says_so(tmp_path: Path, capsys) -> None:
    module = tmp_path / "mismatch.py"
    module.write_text("import torch\n"
                      "def make_model():\n    return torch.nn.Linear(4, 2)\n"
                      "def make_batch(n):\n    return torch.randn(n, 3), torch.randint(0, 2, (n,))\n")
    assert cli.main(["scaling", "--model", f"{module}:make_model", "--batch", f"{module}:make_batch"]) == EXIT_UNKNOWN
    err = capsys.readouterr().err
    assert "on a batch from --batch" in err and "RuntimeError" in err and err.count("\n") == 1


def test_a_good_model_is_measured_once_on_the_cpu() -> None:
    import sys

    sys.path.insert(0, str(Path(TINY).parent))
    import tiny_model

    found = validate(ModelSpec(model=f"{TINY}:make_model", batch=f"{TINY}:make_batch"))
    assert found == {"parameters": tiny_model.parameter_count(), "gradient_bytes": 4 * tiny_model.parameter_count()}
    assert validate(ModelSpec()) == {}


@pytest.mark.parametrize("argv, words", [
    (["scaling", "--sizes", "0,2"], "world sizes of 1 or more"),
    (["scaling", "--sizes", "a"], "not a list of world sizes"),
    (["scaling", "--min-efficiency", "2:95,1:50"], "RANKS:PERCENT"),
    (["scaling", "--min-efficiency", "4:120"], "RANKS:PERCENT"),
    (["scaling", "--seconds", "0"], "out of range"),
])
def test_bad_scaling_flags_are_one_line(capsys, argv, words) -> None:
    assert cli.main(argv) == EXIT_UNKNOWN
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_the_api_passes_functions_to_the_ranks_by_name(monkeypatch) -> None:
    from ddpdoctor import api
    from ddpdoctor.core.errors import UsageError

    assert api.factory_spec(validate, "model") == "ddpdoctor.runtime.user_model:validate"
    assert api.factory_spec("m:f", "model") == "m:f" and api.factory_spec(None, "model") is None

    def nested() -> None:
        return None

    for bad in (lambda: None, nested):
        with pytest.raises(UsageError, match="defined at module level"):
            api.factory_spec(bad, "model")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="this process is a rank already"):
        api.check(nproc=2)


@pytest.mark.parametrize("source, words", [
    ("import argparse\nargparse.ArgumentParser().parse_args(['--nope'])\n", "SystemExit(2): it exits when imported"),
    ("import torch\nimport no_such_dependency_xyz\n", "raised ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
    ("import torch\n"
     "class M(torch.nn.Module):\n"
     "    def __init__(self):\n        super().__init__()\n"
     "        self.used = torch.nn.Linear(4, 2)\n        self.pooler = torch.nn.Linear(4, 4)\n"
     "    def forward(self, x):\n        return self.used(x)\n"
     "def make_model():\n    return M()\n", "2 trainable parameter(s) get no gradient (first: pooler.weight)"),
])
def test_user_code_that_exits_imports_a_missing_package_or_leaves_parameters_unused(tmp_path, capsys, source,
                                                                                   words) -> None:
    module = tmp_path / "user.py"
    module.write_text(source + "def make_batch(n):\n    import torch\n    return torch.randn(n, 4), torch.randint(0, 2, (n,))\n")
    assert cli.main(["check", "--model", f"{module}:make_model", "--batch", f"{module}:make_batch"]) == EXIT_UNKNOWN
    last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse in the user's file prints its own usage first
    assert last.startswith("ddpdoctor: error: ") and words in last, last


def test_the_api_refuses_to_recurse_from_a_script_loaded_as_a_factory(monkeypatch) -> None:
    from ddpdoctor import api
    from ddpdoctor.core.errors import UsageError

    monkeypatch.setenv(api.CHILD_VAR, "1")
    with pytest.raises(UsageError, match="calls the API at import"):
        api.scaling(nproc=2)

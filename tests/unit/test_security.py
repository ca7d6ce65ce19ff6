"""Security properties, each checked rather than promised (docs/security.md):

- no shell, eval or exec anywhere in ddpdoctor/ and probes/ (an AST scan, itself tested);
- nothing unpickled from files or peers except through flight_recorder's refusing
  unpickler, and a hostile pickle given to `explain` or `diagnose` runs nothing;
- the standalone launcher's store listens on 127.0.0.1 only;
- secrets in the environment, the command line, errors and logs never reach a JSON file.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import pickle
import socket
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

from ddpdoctor import cli
from ddpdoctor.core.redact import REDACTED

from . import cli_guard

no_launch = cli_guard.no_launch  # autouse: no rank may start from these tests

ROOT = Path(__file__).resolve().parent.parent.parent
SOURCES = sorted([*(ROOT / "ddpdoctor").rglob("*.py"), *(ROOT / "probes").rglob("*.py")])

# == the AST scan =================================================================================

# Nothing is allow-listed: no module needs a shell, and user code (--model) is imported by
# name through importlib, never evaluated from a string.
SHELL_CALLS = {"os.system", "os.popen", "posix.system", "subprocess.getoutput", "subprocess.getstatusoutput",
               "pty.spawn", "commands.getoutput", "commands.getstatusoutput", "platform.popen",
               "eval", "exec", "builtins.eval", "builtins.exec"}
UNPICKLING_CALLS = {"pickle.load", "pickle.loads", "_pickle.load", "_pickle.loads", "cPickle.load", "cPickle.loads",
                    "marshal.load", "marshal.loads", "shelve.open", "dill.load", "dill.loads", "cloudpickle.load",
                    "cloudpickle.loads", "joblib.load", "yaml.load", "yaml.unsafe_load", "pandas.read_pickle"}
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
# The one place that may import pickle: its Unpickler subclass refuses every global.
UNPICKLER_HOME = "ddpdoctor/judge/flight_recorder.py"


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted name, from the module's imports (`import subprocess as sp`, `from os import system`)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _is_true(node: Optional[ast.AST]) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def scan(source: str, path: str) -> list[str]:
    """Every shell, eval/exec and unpickling use in `source`, as 'path:line: what'."""
    tree = ast.parse(source, path)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)) and path != UNPICKLER_HOME:
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{where}: imports {m}" for m in modules if m.split(".")[0] in PICKLE_MODULES]
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if _dotted(base, aliases) in ("pickle.Unpickler", "_pickle.Unpickler") and not _refuses_globals(node):
                    found.append(f"{where}: {node.name} unpickles without a find_class that refuses")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases) or ""
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if "shell" in keywords and not (isinstance(keywords["shell"], ast.Constant) and keywords["shell"].value is False):
            found.append(f"{where}: shell= in a call to {name}")
        if name in SHELL_CALLS:
            found.append(f"{where}: {name}")
        if name in UNPICKLING_CALLS:
            found.append(f"{where}: {name}")
        if name in ("torch.load", "torch.serialization.load") and not _is_true(keywords.get("weights_only")):
            found.append(f"{where}: {name} without weights_only=True")
        if name in ("numpy.load", "np.load") and "allow_pickle" in keywords and not (
                isinstance(keywords["allow_pickle"], ast.Constant) and keywords["allow_pickle"].value is False):
            found.append(f"{where}: {name} with allow_pickle")
    return found


def _refuses_globals(cls: ast.ClassDef) -> bool:
    """find_class defined, and all it does is raise (a docstring aside)."""
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == "find_class":
            body = [s for s in item.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            return len(body) == 1 and isinstance(body[0], ast.Raise)
    return False


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_scan_covers_the_packages():
    names = {_relative(p) for p in SOURCES}
    assert {"ddpdoctor/cli.py", "ddpdoctor/session/launcher.py", UNPICKLER_HOME, "probes/allreduce/probe.py"} <= names
    assert len(names) > 60


def test_no_shell_eval_exec_or_unpickling_in_the_packages():
    found = [hit for path in SOURCES for hit in scan(path.read_text(encoding="utf-8"), _relative(path))]
    assert found == []


def test_the_only_unpickler_is_the_refusing_one():
    source = (ROOT / UNPICKLER_HOME).read_text(encoding="utf-8")
    tree = ast.parse(source)
    aliases = _aliases(tree)
    unpicklers = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                  and any(_dotted(b, aliases) == "pickle.Unpickler" for b in n.bases)]
    assert [c.name for c in unpicklers] == ["_PlainDataUnpickler"] and _refuses_globals(unpicklers[0])
    users = [p for p in SOURCES if "flight_recorder import" in p.read_text() and "loads_plain" in p.read_text()]
    assert {_relative(p) for p in users} <= {"ddpdoctor/measure/fr_snapshot.py", "ddpdoctor/explain/command.py", UNPICKLER_HOME}


@pytest.mark.parametrize("source", [
    "import os\nos.system('ls')",
    "import os as o\no.popen('ls')",
    "from os import system\nsystem('ls')",
    "import subprocess as sp\nsp.run('ls', shell=True)",
    "import subprocess\nsubprocess.Popen(cmd, shell=flag)",
    "import subprocess\nsubprocess.getoutput('ls')",
    "from subprocess import getstatusoutput\ngetstatusoutput('ls')",
    "eval('1 + 1')",
    "exec(code)",
    "import builtins\nbuiltins.exec(code)",
    "import pickle\npickle.loads(raw)",
    "from pickle import load\nload(handle)",
    "import pickle\nclass U(pickle.Unpickler):\n    pass",
    "import pickle\nclass U(pickle.Unpickler):\n    def find_class(self, m, n):\n        return super().find_class(m, n)",
    "import torch\ntorch.load('x.pt')",
    "import torch\ntorch.load('x.pt', weights_only=False)",
    "import marshal\nmarshal.loads(raw)",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
])
def test_the_scan_finds_what_it_looks_for(source):
    assert scan(source, "ddpdoctor/example.py"), source


@pytest.mark.parametrize("source", [
    "import subprocess\nsubprocess.run(['ls', path])",
    "import subprocess\nsubprocess.Popen(cmd, shell=False)",
    "import torch\ntorch.load('x.pt', weights_only=True)",
    "import json\njson.loads(raw)",
    "model.eval()",  # a method called eval is not the builtin
])
def test_the_scan_lets_the_safe_forms_pass(source):
    assert scan(source, "ddpdoctor/example.py") == []


# == hostile pickles ==============================================================================

class _RunsShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_refusing_unpickler_refuses_code_and_keeps_plain_data(tmp_path):
    from ddpdoctor.judge.flight_recorder import loads_plain

    marker = tmp_path / "PWNED"
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        loads_plain(pickle.dumps(_RunsShell(marker), protocol=4))
    assert not marker.exists()
    plain = {"entries": [{"seq": 1, "sizes": [[8]], "ok": True, "t": 1.5, "none": None, "raw": b"x"}], "v": "2.10"}
    assert loads_plain(pickle.dumps(plain, protocol=4)) == plain


@pytest.mark.parametrize("wrap", ["inside-entries", "top-level"])
def test_a_malicious_pickle_given_to_explain_runs_nothing(capsys, tmp_path, monkeypatch, wrap):
    """Named like torch's dump for rank 0, so it really goes through the unpickler."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "PWNED"
    payload = _RunsShell(marker)
    if wrap == "inside-entries":
        payload = {"version": "2.10", "pg_config": {}, "entries": [payload]}
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(payload, protocol=4))
    (tmp_path / "rank0.log").write_text("step 1 loss 2.3\n")
    code = cli.main(["explain", str(tmp_path / "nccl_trace_rank_0"), str(tmp_path / "rank0.log"),
                     "--json", str(tmp_path / "why.json")])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "" and "Traceback" not in captured.out
    assert not marker.exists()
    notes = json.loads((tmp_path / "why.json").read_text())["inputs"]["notes"]
    assert any("nccl_trace_rank_0: not a readable Flight Recorder dump" in n and "refused" in n for n in notes)


def test_a_pickle_given_to_diagnose_is_never_unpickled(capsys, tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "report.json"
    path.write_bytes(pickle.dumps({"schema": "ddpdoctor.report/1", "x": _RunsShell(marker)}, protocol=4))
    assert cli.main(["diagnose", str(path)]) == 3
    assert "looks like a pickle: diagnose reads JSON only and never unpickles" in cli_guard.one_error_line(capsys)
    assert not marker.exists()


# == the standalone store listens on loopback only ==================================================

def _listening(port: int) -> list[str]:
    import psutil

    return [c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]


def _other_addresses() -> Iterator[str]:
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                yield a.address


def test_the_launchers_store_listens_on_127_0_0_1_only():
    """The launcher's own code path: _listen binds the port, the store takes its fd."""
    from ddpdoctor.runtime.channel import Channel
    from ddpdoctor.session.launcher import _listen

    sock, port = _listen(None)
    channel = Channel.connect("127.0.0.1", port, 5.0, is_master=True, listen_fd=sock.detach())
    try:
        channel.set("probe", {"ok": True})  # it serves
        assert channel.get("probe") == {"ok": True}
        assert _listening(port) == ["127.0.0.1"]  # one listener, on loopback: not 0.0.0.0, not ::
        for address in _other_addresses():  # and this host's own other addresses cannot reach it
            with pytest.raises(OSError):
                socket.create_connection((address, port), timeout=1.0).close()
    finally:
        del channel
        gc.collect()
    deadline = time.monotonic() + 5
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listening(port) == []  # and nothing is left listening


def test_a_busy_port_is_one_clear_error():
    from ddpdoctor.core.errors import UsageError
    from ddpdoctor.session.launcher import _listen

    sock, port = _listen(None)
    try:
        with pytest.raises(UsageError, match=f"port {port} on 127.0.0.1 is not free"):
            _listen(port)
    finally:
        sock.close()


# == secrets never reach a JSON file ================================================================

HF = "hf_" + "Zq7Xw2Vb9Nm4Lk8Jh3Gf6Ds1Ap5"
GHP = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
WANDB = "f00dfeedcafe1234f00dfeedcafe1234f00dfeed"
URL_PASSWORD = "pa55word-xyz"
SECRETS = (HF, GHP, WANDB, URL_PASSWORD, "hunter2-pw", "sk-" + "proj-4fJ9kLm2Qx7Rt5Vw8Yz1Ab3Cd")


def _assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, secret


def test_a_report_file_carries_no_secret_from_env_command_errors_or_logs(tmp_path, capsys):
    """Every place a run record holds free text: facts (an env dict, as a collector that forgot
    relevant_env would record it), the command line, an exception's message and traceback,
    a watchdog's stack, a rank's log tail."""
    from ddpdoctor.core.report import write_json
    from ddpdoctor.session.reporter import build_report

    from .test_report import COMMAND, SHA, crashed_record, healthy_record

    record = healthy_record(2)
    record.results["ddp-smoke"][0]["env"] = {"HF_TOKEN": HF, "WANDB_API_KEY": WANDB, "MY_PASSWORD": "hunter2-pw",
                                             "NCCL_NET_PLUGIN_ARGS": f"--opt {GHP}", "NCCL_ALGO": "Ring"}
    crashed = crashed_record()
    crashed.errors = {1: {"stage": "train", "type": "HTTPError", "t": 1.0,
                          "message": f"401 for https://alice:{URL_PASSWORD}@hub.example.com/api",
                          "traceback": f'  File "train.py", line 3\n    token = "{HF}"\nHTTPError: 401'}}
    crashed.timeouts[0]["stack"] += f'  File "train.py", line 9 in login\n    key = "{SECRETS[5]}"\n'
    crashed.exits[1].log_tail = [f"wandb: WANDB_API_KEY={WANDB}", "export MY_PASSWORD=hunter2-pw"]
    command = [*COMMAND, "--model", f"https://bob:{URL_PASSWORD}@git.example.com/m.py:build", "--inject",
               f"crash:rank=1:stage=train --token {GHP}"]
    for n, rec in enumerate((record, crashed)):
        path = tmp_path / f"r{n}.json"
        write_json(build_report(rec, command=command), str(path))
        text = path.read_text()
        _assert_clean(text)
        data = json.loads(text)
        assert data["command"][:4] == COMMAND and "git.example.com/m.py:build" in data["command"][5]
        if n == 0:
            env = data["probes"][0]["facts"]["0"]["env"]
            assert env == {"HF_TOKEN": REDACTED, "WANDB_API_KEY": REDACTED, "MY_PASSWORD": REDACTED,
                           "NCCL_NET_PLUGIN_ARGS": f"--opt {REDACTED}", "NCCL_ALGO": "Ring"}
            assert data["probes"][0]["facts"]["1"]["param_sha256"] == SHA  # hashes are not secrets
        else:
            assert "hub.example.com" in text and "export MY_PASSWORD=" + REDACTED in text
    assert capsys.readouterr().err == ""


def test_a_snapshot_carries_no_secret_from_the_environment(monkeypatch, tmp_path):
    from ddpdoctor.snapshot import take_snapshot, write_snapshot

    for name, value in {"HF_TOKEN": HF, "WANDB_API_KEY": WANDB, "MY_PASSWORD": "hunter2-pw",
                        "DATABASE_URL": f"postgres://app:{URL_PASSWORD}@db/x", "NCCL_NET_PLUGIN_ARGS": f"-t {GHP}",
                        "TORCH_NCCL_TRACE_URL": f"https://alice:{URL_PASSWORD}@traces.example.com/up"}.items():
        monkeypatch.setenv(name, value)
    path = write_snapshot(take_snapshot(measure=False), str(tmp_path / "s.json"))
    text = Path(path).read_text()
    _assert_clean(text)
    assert "traces.example.com" in text  # the setting is kept, its password is not


def test_explains_json_carries_no_secret_from_the_logs(capsys, tmp_path):
    log = tmp_path / "job.log"
    log.write_text("[rank1]: Traceback (most recent call last):\n"
                   f'[rank1]:   File "/job/train.py", line 7, in <module>\n'
                   f"[rank1]: RuntimeError: 401 Client Error for url: https://alice:{URL_PASSWORD}@hub.example.com/api "
                   f"HF_TOKEN={HF} --password hunter2-pw {GHP}\n"
                   "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6528\n")
    out = tmp_path / "why.json"
    assert cli.main(["explain", str(log), "--json", str(out)]) == 2
    from ddpdoctor.explain.command import explain

    for text in (out.read_text(), json.dumps(explain([str(log)]).to_json())):
        _assert_clean(text)
        assert "401 Client Error for url: https://alice:" + REDACTED + "@hub.example.com/api" in text
    capsys.readouterr()

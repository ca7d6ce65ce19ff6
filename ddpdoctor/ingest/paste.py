"""A paste as users make it, cut into the tool outputs it holds.

Users copy a terminal into a ticket or a file: the shell prompt and the command line come with
the output, a terminal's colours come as ANSI escapes, Windows editors add CR line ends, and one
paste often holds two outputs (`nvidia-smi topo -m`, then `nvidia-smi nvlink -s`; or `topo -m`,
then an nccl-tests run). Every reader expects one tool's output with plain line ends, so a paste
is first cleaned (`clean`), then cut at each command line and at each bare prompt (`split`): each
part is one tool's output, read by its own reader (load.py), and the result names which lines of
the file were read as what.

A command line is a shell prompt followed by a command (`user@gpu01:~$ nvidia-smi topo -m`,
`[root@node2 ~]# nvidia-smi nvlink -s`, `(venv) $ ...`, `sh-5.1# dcgmi diag -r 3`), or a known
tool's command alone on its line (`nvidia-smi topo --matrix`). A bare `#`, `>` or `%` prompt
counts only before a known tool: nccl-tests' own output starts its lines with `# `.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# CSI (colours, underline: ESC [ ... m), OSC (window titles: ESC ] ... BEL), and two-byte escapes.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# The tools whose outputs ingest reads, and the launchers that run nccl-tests.
_TOOL = r"(?:\S*/)?(?:nvidia-smi|dcgmi|\w+_perf|mpirun|mpiexec|srun|nccl-tests)\b"
_ENVS = r"(?:\((?:[^()\n]|\([^()\n]*\))*\)\s*)*"  # (venv) (base) ((python_venv3.12) ): any number, before any prompt
# Prompts that only a shell prints: user@host..., [user@host dir], sh-5.1, bash-4.2.
_OWN = re.compile(r"^\s*" + _ENVS + r"(?:(?P<user>[\w.+-]+)@(?P<host>[\w.-]+)(?::[^\s$#%]*)?(?:\s+[^\s$#%]+)?\s*[$#%]"
                  r"|\[(?P<buser>[\w.+-]+)@(?P<bhost>[\w.-]+)[^\]\n]*\][$#%]"
                  r"|(?:ba|z|k)?sh-\d+(?:\.\d+)*[$#])(?:\s|$)")
# `$ cmd` and `(venv) $ cmd`: `$` starts no line of any output ingest reads.
_DOLLAR = re.compile(r"^\s*" + _ENVS + r"\$(?:\s+|$|(?=" + _TOOL + "))")
# `# cmd`, `> cmd`, `% cmd`: a prompt only before a known tool (`# Using devices` is nccl-tests').
_BARE = re.compile(r"^\s*" + _ENVS + r"[#>%]\s+(?=(?:sudo\s+)?" + _TOOL + ")")
# `nvidia-smi topo --matrix` alone on its line: the tool, then words and options only.
_COMMAND = re.compile(r"^\s*(?:sudo\s+)?" + _TOOL + r"(?:[ \t]+[\w./=,:+@'-]+)*[ \t]*$")


def clean(text: str) -> str:
    """The text without ANSI escapes, a byte-order mark and CR line ends: what the terminal showed."""
    text = _ANSI.sub("", text).lstrip("\ufeff")
    return text.replace("\r\n", "\n").replace("\r", "\n")


@dataclass
class Prompt:
    """A line that starts a part: the command it ran (None for a bare prompt), and the host its prompt names."""

    command: Optional[str]
    host: Optional[str]


def prompt(line: str) -> Optional[Prompt]:
    """The line as a prompt or command line, or None for a line of output."""
    own = _OWN.match(line)
    if own:
        rest = line[own.end():].strip()
        return Prompt(rest or None, own.group("host") or own.group("bhost"))
    for form in (_DOLLAR, _BARE):
        match = form.match(line)
        if match:
            return Prompt(line[match.end():].strip() or None, None)
    if _COMMAND.match(line):
        return Prompt(line.strip(), None)
    return None


def starts_with_prompt(text: str) -> bool:
    """Whether the first line that is not blank is a prompt or a command line: a paste, not JSON
    (`[root@node2 ~]# ...` starts with a bracket, `(venv) $ ...` with a parenthesis)."""
    first = next((line for line in clean(text).splitlines() if line.strip()), "")
    return prompt(first) is not None


@dataclass
class Part:
    """Lines `first`..`last` (1-based, inclusive) of the paste: one command's output, with its command line."""

    first: int
    last: int
    text: str
    command: Optional[str] = None
    host: Optional[str] = None  # named by the part's prompt (`root@test1:/#`), where it names one

    def label(self, path: str) -> str:
        return f"{path} (lines {self.first}-{self.last})"


def split(text: str) -> list[Part]:
    """The cleaned paste cut before every prompt or command line; a bare prompt (the one left after
    the last command) ends the part above it and starts none. Parts with nothing but blank lines
    are dropped."""
    lines = clean(text).splitlines()
    parts: list[Part] = []
    start, said = 0, Prompt(None, None)
    for number, line in enumerate(lines):
        seen = prompt(line)
        if seen is None:
            continue
        parts.append(_part(lines, start, number, said))
        start, said = (number, seen) if seen.command else (number + 1, Prompt(None, seen.host))
    parts.append(_part(lines, start, len(lines), said))
    return [p for p in parts if any(line.strip() for line in p.text.splitlines()
                                    if prompt(line) is None)]


def _part(lines: list[str], start: int, end: int, said: Prompt) -> Part:
    return Part(start + 1, max(start + 1, end), "\n".join(lines[start:end]) + "\n", said.command, said.host)

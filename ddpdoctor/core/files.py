"""Writing ddpdoctor's files: strict JSON with secrets redacted, written atomically.

An unnamed or temp file, then named in one step, so a killed run never leaves half a file
behind, and never over an existing file unless the user passed --force (then the file goes to a
free sibling name: report.1.json, ...). Every JSON file ddpdoctor writes passes here.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import tempfile
import uuid
from typing import Any, Iterator, Optional

from ddpdoctor.core.redact import redact_json


def _finite(value: Any) -> Any:
    """NaN and infinities become null: strict JSON parsers (jq, Go, JS) reject bare NaN."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def atomic_write_json(data: Any, path: str, *, overwrite: bool = True) -> str:
    """Strict JSON with secrets redacted, written atomically; returns the path written.

    Every JSON file ddpdoctor writes passes here, so redaction (token shapes, URL passwords,
    secret-named variables) is applied once for all of them, whatever a fact or a log held.
    """
    text = json.dumps(redact_json(_finite(data)), indent=2, default=str, allow_nan=False) + "\n"
    return atomic_write_text(text, path, overwrite=overwrite)


def atomic_write_text(text: str, path: str, *, overwrite: bool = True) -> str:
    return atomic_write_bytes(text.encode("utf-8"), path, overwrite=overwrite)


MAX_SIBLINGS = 1000  # report.1.json ... report.999.json, then give up with an error


def sibling_names(path: str) -> Iterator[str]:
    """`path`, then report.1.json, report.2.json, ...: where a refused overwrite goes instead."""
    yield path
    root, ext = os.path.splitext(path)
    for n in range(1, MAX_SIBLINGS):
        yield f"{root}.{n}{ext}"


def atomic_write_bytes(data: bytes, path: str, *, overwrite: bool = True) -> str:
    """Write `data` to `path` so that no reader, and no killed writer, ever sees half a file.

    The data goes to a file with no name (O_TMPFILE, Linux) or a hidden temp file in the
    same folder, and is then given its name in one step: rename over the target when
    `overwrite`, else a hard link, which fails if the name exists, so a file that appeared
    since the CLI's check is never replaced: the data goes to the first free sibling name
    (report.1.json, ...) and a line on stderr says where. Returns the path written.
    Library callers that rewrite their own file (Doctor, every N steps) keep the default.
    """
    directory = os.path.dirname(os.path.abspath(path)) or "."
    try:
        written = _write_and_name(data, path, overwrite, directory, unnamed=True)
    except _NoUnnamedFile:
        written = _write_and_name(data, path, overwrite, directory, unnamed=False)
    if written != path:
        sys.stderr.write(f"ddpdoctor: {path} appeared while ddpdoctor ran and was not overwritten: "
                         f"wrote {written} instead (pass --force to overwrite)\n")
    return written


class _NoUnnamedFile(Exception):
    """O_TMPFILE is missing, or its file cannot be named through /proc (no /proc, a sandbox)."""


def _write_and_name(data: bytes, path: str, overwrite: bool, directory: str, unnamed: bool) -> str:
    fd, tmp = _unnamed_file(directory) if unnamed else _temp_file(directory)
    try:
        _write_all(fd, data)
        os.fsync(fd)  # the rename is atomic; without this, a crash could still name an empty file
        if tmp is not None:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        return _give_name(fd, tmp, path, overwrite)
    finally:
        os.close(fd)
        if tmp is not None:
            _unlink_quietly(tmp)  # after a link (or a failure); after a rename it is already gone


def _unnamed_file(directory: str) -> tuple[int, None]:
    """An O_TMPFILE file, which vanishes if we are killed before it is named."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        raise _NoUnnamedFile()
    try:
        return os.open(directory, flag | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o666), None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):  # not on this file system
            raise _NoUnnamedFile() from exc
        raise  # EACCES, ENOENT, ENOSPC, ...: a named temp file would fail the same way


def _temp_file(directory: str) -> tuple[int, str]:
    """A hidden temp file: where O_TMPFILE is missing (not Linux, some network file systems)."""
    return tempfile.mkstemp(prefix=".ddpdoctor-", suffix=".tmp", dir=directory)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[: 1 << 20]):]


def _link(fd: int, tmp: Optional[str], target: str) -> None:
    """Give the data the name `target`; FileExistsError if it is taken, never replaces."""
    if tmp is not None:
        os.link(tmp, target)
        return
    directory, name = os.path.split(os.path.abspath(target))
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        # dst_dir_fd makes Python call linkat(AT_SYMLINK_FOLLOW): the /proc link leads to the file.
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
    except FileExistsError:
        raise
    except OSError as exc:  # /proc without that link (hidepid, a sandbox): a named temp file will do
        raise _NoUnnamedFile() from exc
    finally:
        os.close(dir_fd)


def _give_name(fd: int, tmp: Optional[str], path: str, overwrite: bool) -> str:
    if overwrite:
        if tmp is None:  # an unnamed file needs a (hidden) name before it can be renamed over
            tmp = _hidden_name(fd, path)
            try:
                os.replace(tmp, path)
            except BaseException:
                _unlink_quietly(tmp)
                raise
        else:
            os.replace(tmp, path)
        return path
    for candidate in sibling_names(path):
        try:
            _link(fd, tmp, candidate)
            return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            if tmp is None or exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            # A file system without hard links: claim the name (O_EXCL fails if it is taken),
            # then rename the complete temp file onto our own empty claim.
            try:
                os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:
                continue
            os.replace(tmp, candidate)
            return candidate
    raise FileExistsError(f"{path} and its {MAX_SIBLINGS - 1} sibling names all exist: nothing was overwritten")


def _hidden_name(fd: int, path: str) -> str:
    for _ in range(100):
        candidate = os.path.join(os.path.dirname(os.path.abspath(path)), f".ddpdoctor-{uuid.uuid4().hex[:12]}.tmp")
        try:
            _link(fd, None, candidate)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

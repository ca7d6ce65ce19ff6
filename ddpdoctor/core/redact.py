"""Which environment variables a report may carry, and with secrets blanked out.

Reports and snapshots get attached to bug reports and pasted into chats. Job
environments hold tokens (W&B, Hugging Face, cloud keys) and URLs with passwords, so
only the variables that shape distributed training are kept, and even among those any
value that looks like a secret is replaced: a false positive costs a "<redacted>",
a false negative leaks a credential.

Free text that reaches a file (command lines, exception messages, log lines quoted by
`explain`, rank log tails) cannot be filtered by name, so `redact_text` blanks the parts
shaped like a credential, and `redact_json` applies both rules to a whole JSON document:
every JSON file ddpdoctor writes passes through it.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

REDACTED = "<redacted>"

# What decides how NCCL, gloo and the CPU threads behave.
RELEVANT_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "CUDA_", "OMP_",
                     "MKL_NUM_THREADS", "UCX_", "FI_", "NVIDIA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")

# KEY only where a word of the name starts with it (NCCL_IB_KEY, SSH_KEYFILE, KEY_PATH): the
# InfiniBand partition key NCCL_IB_PKEY is a setting to compare across ranks, not a secret.
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSW|PASSWD|PWD|CREDENTIAL|AUTH|API_?KEY|ACCESS_?KEY|PRIVATE|COOKIE|SESSION"
                          r"|(?<![a-z0-9])KEY)", re.IGNORECASE)
# The password runs to the last "@" before the path, as urllib reads it (p@ss is one password).
# A scheme starts a word (the lookbehind): tried from every letter of a long word, the
# pattern would cost time quadratic in its length, and log lines can be megabytes.
_URL_CREDENTIALS = re.compile(r"(?<![a-z0-9+.-])(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^/@:\s]*):"
                              r"(?P<password>[^/\s]+)@", re.IGNORECASE)
# In free text: `HF_TOKEN=...`, `--password=...`, `?api_key=...` and `--token VALUE`. Names are
# found by these linear patterns and judged by _SECRET_NAME in code, for the same reason.
# Also `api_key = "..."` (a source line in a traceback), `password: x` and `"password": "x"`.
_NAME_EQUALS = re.compile(r"(?<![\w.-])[\"']?([\w.-]+)[\"']?\s*[:=]\s*")
# HTTP credentials in a header line: `Authorization: Bearer <token>` / `Basic <base64>`.
_AUTH_SCHEME = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
_FLAG_SPACE = re.compile(r"(?<![\w-])(--?[\w-]+)\s+(?=[^\s-])")
_VALUE = re.compile(r"\"[^\"]*\"?|'[^']*'?|[^\s&;,'\"]+")
# Well-known token shapes: GitHub, Hugging Face, Slack, AWS access keys, OpenAI-style keys, JWTs.
_TOKEN_SHAPES = re.compile(
    r"(gh[pousr]_[A-Za-z0-9]{20,}|hf_[A-Za-z0-9]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}"
    r"|sk-[A-Za-z0-9_-]{20,}|(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})")
# A long run of mixed letters and digits with no separators looks like a key, not a setting.
_OPAQUE = re.compile(r"^[A-Za-z0-9+/=_-]{32,}$")
# CUDA_VISIBLE_DEVICES UUIDs: GPU-<uuid>, MIG-<uuid>, and the pre-R470 MIG-GPU-<uuid>/gi/ci.
_DEVICE_ID = r"(MIG-GPU-|GPU-|MIG-)[0-9A-Fa-f/-]+"
_DEVICE_IDS = re.compile(rf"^{_DEVICE_ID}(,{_DEVICE_ID})*$")


def is_relevant(name: str) -> bool:
    return name == "OMP_NUM_THREADS" or name.startswith(RELEVANT_PREFIXES)


def redact_value(name: str, value: str) -> str:
    if _SECRET_NAME.search(name):
        return REDACTED
    if _TOKEN_SHAPES.search(value):
        return REDACTED
    if (_OPAQUE.match(value) and not _DEVICE_IDS.match(value)
            and any(c.isdigit() for c in value) and any(c.isalpha() for c in value)):
        return REDACTED
    return _assignments(_URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", value))


def _assignments(text: str) -> str:
    """`NAME=secret` and `--token secret` in a value or a line: the name kept, the value blanked."""
    for pattern in (_NAME_EQUALS, _FLAG_SPACE):
        pieces, done = [], 0
        for match in pattern.finditer(text):
            if match.start() < done or not _SECRET_NAME.search(match.group(1)):
                continue
            if text.startswith(REDACTED, match.end()):  # already blanked: a URL's user named "key" (key:<redacted>@)
                continue
            value = _VALUE.match(text, match.end())
            if value is None:
                continue
            pieces += [text[done:match.end()], REDACTED]
            done = value.end()
        text = "".join(pieces) + text[done:]
    return text


def relevant_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The training-relevant variables of `environ`, sorted, secrets redacted."""
    source = os.environ if environ is None else environ
    return {name: redact_value(name, value) for name, value in sorted(source.items()) if is_relevant(name)}


# An environment variable's name, as a key in a JSON document (facts keep env dicts).
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def redact_text(text: str) -> str:
    """`text` with token shapes, URL passwords and the values of secret-named assignments
    (`HF_TOKEN=...`, `--password x`) blanked in place, the rest kept.

    Unlike redact_value, no long-opaque-string rule: free text holds hashes and ids
    (param_sha256, run ids) that a report needs and that are not secrets.
    """
    if not text:
        return text
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", _TOKEN_SHAPES.sub(REDACTED, text))
    text = _AUTH_SCHEME.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    return _assignments(text)


def redact_json(data: Any) -> Any:
    """A copy of a JSON-able document with secrets blanked: every string through
    redact_text, and the value of any environment-variable-named key that names a secret."""
    if isinstance(data, str):
        return redact_text(data)
    if isinstance(data, Mapping):
        out = {}
        for key, value in data.items():
            if isinstance(key, str) and isinstance(value, str) and _ENV_NAME.match(key) and _SECRET_NAME.search(key):
                out[key] = REDACTED
            else:
                out[key] = redact_json(value)
        return out
    if isinstance(data, (list, tuple)):
        return [redact_json(v) for v in data]
    return data

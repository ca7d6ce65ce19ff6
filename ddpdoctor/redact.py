"""Which environment variables a report may carry, and with secrets blanked out.

Reports and snapshots get attached to bug reports and pasted into chats. Job
environments hold tokens (W&B, Hugging Face, cloud keys) and URLs with passwords, so
only the variables that shape distributed training are kept, and even among those any
value that looks like a secret is replaced: a false positive costs a "<redacted>",
a false negative leaks a credential.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

REDACTED = "<redacted>"

# What decides how NCCL, gloo and the CPU threads behave.
RELEVANT_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "CUDA_", "OMP_",
                     "MKL_NUM_THREADS", "UCX_", "FI_", "NVIDIA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")

_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSW|PASSWD|PWD|CREDENTIAL|AUTH|API_?KEY|ACCESS_?KEY|PRIVATE|COOKIE|SESSION)",
                          re.IGNORECASE)
# The password runs to the last "@" before the path, as urllib reads it (p@ss is one password).
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<password>[^/\s]+)@",
                              re.IGNORECASE)
# Well-known token shapes: GitHub, Hugging Face, Slack, AWS access keys, OpenAI-style keys, JWTs.
_TOKEN_SHAPES = re.compile(
    r"(gh[pousr]_[A-Za-z0-9]{20,}|hf_[A-Za-z0-9]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}"
    r"|sk-[A-Za-z0-9_-]{20,}|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})")
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
    if _OPAQUE.match(value) and not _DEVICE_IDS.match(value) and any(c.isdigit() for c in value) and any(c.isalpha() for c in value):
        return REDACTED
    return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", value)


def relevant_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The training-relevant variables of `environ`, sorted, secrets redacted."""
    source = os.environ if environ is None else environ
    return {name: redact_value(name, value) for name, value in sorted(source.items()) if is_relevant(name)}

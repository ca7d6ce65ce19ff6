"""Every NVML call goes through `query`: a missing library, driver or function is a value.

NVML is optional on a rank (CPU nodes have no driver), and the bindings track the driver
branch, so any call may fail with "not supported" or "function not found". A probe asks,
and gets either the value or `Unknown(reason)` to record in its facts; it never crashes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union


@dataclass(frozen=True)
class Unknown:
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"unknown": self.reason}


Value = Union[Any, Unknown]

_state: dict[str, Any] = {"initialised": False, "error": None}


def _module() -> Any:
    import pynvml  # from the nvidia-ml-py package

    return pynvml


def init() -> Optional[Unknown]:
    """Initialise once per process; None when NVML works, else why it does not."""
    if _state["initialised"]:
        return None
    if _state["error"] is not None:
        return _state["error"]
    try:
        _module().nvmlInit()
    except ImportError:
        _state["error"] = Unknown("the pynvml module (package nvidia-ml-py) is not installed")
    except Exception as exc:
        _state["error"] = Unknown(f"NVML unavailable: {_describe(exc)}")
    else:
        _state["initialised"] = True
    return _state["error"]


def query(function: str, *args: Any, convert: Callable[[Any], Any] = lambda v: v) -> Value:
    """`query("nvmlDeviceGetUUID", handle)` → the value, or Unknown with the reason."""
    problem = init()
    if problem is not None:
        return problem
    pynvml = _module()
    fn = getattr(pynvml, function, None)
    if fn is None:
        return Unknown(f"{function} is not in this nvidia-ml-py version")
    try:
        return convert(fn(*args))
    except Exception as exc:
        return Unknown(f"{function}: {_describe(exc)}")


def text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _describe(exc: Exception) -> str:
    message = str(exc).strip() or type(exc).__name__
    return message.splitlines()[0][:200]


def plain(value: Value) -> Any:
    """For facts: a JSON-able value, with Unknown as {"unknown": reason}."""
    return value.to_json() if isinstance(value, Unknown) else value

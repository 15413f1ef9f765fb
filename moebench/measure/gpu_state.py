"""The GPU's clocks, temperature, power and throttle reasons around a point's timed iterations, read through NVML.

Why: single points of a sweep can spread by several percent between runs of the same code on the same machine
while the geometric means repeat; a record that says at which SM clock and for which throttle reasons its samples
were taken lets a reader tell a slower kernel from a slower GPU. Read once before and once after the timed region
(never inside it). NVML comes from the optional `nvidia-ml-py` package (`import pynvml`); without it, or without a
CUDA device, `read` returns None and the record says why (`unavailable`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

_NVML: dict[str, Any] = {}  # "module": pynvml once initialised, or "error": why not


def _pynvml():
    if "module" in _NVML or "error" in _NVML:
        return _NVML.get("module")
    try:
        import pynvml

        pynvml.nvmlInit()
        _NVML["module"] = pynvml
    except Exception as e:  # noqa: BLE001 - absent package, no driver: the records say so
        _NVML["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return _NVML.get("module")


def unavailable(device: torch.device) -> str | None:
    """Why `read` returns None on `device`, or None when it reads."""
    if device.type != "cuda":
        return "not a CUDA device"
    if _pynvml() is None:
        return f"NVML not readable ({_NVML.get('error')}; pip install nvidia-ml-py)"
    return None


def _nvml_index(device: torch.device) -> int:
    """NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES (plain indices) renumbers CUDA's."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.isdigit() for v in visible) and idx < len(visible):
        return int(visible[idx])
    return idx


# NVML's clock-event (throttle) reason bits that slow the SM clock, by name
_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
            0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def _optional(query):
    """A query some drivers or boards refuse (a power limit under a hypervisor): None then, not an error."""
    try:
        return query()
    except Exception:  # noqa: BLE001
        return None


def read(device: torch.device) -> dict[str, Any] | None:
    """{sm_clock_mhz, mem_clock_mhz, max_sm_clock_mhz, temperature_c, power_w, power_limit_w, throttle: [names]}
    now, or None."""
    if unavailable(device) is not None:
        return None
    nv = _NVML["module"]
    try:
        h = nv.nvmlDeviceGetHandleByIndex(_nvml_index(device))
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        bits = int(reasons_fn(h))
        return {"sm_clock_mhz": int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                "mem_clock_mhz": int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
                "max_sm_clock_mhz": int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
                "temperature_c": int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                "power_w": round(nv.nvmlDeviceGetPowerUsage(h) / 1000.0, 1),
                "power_limit_w": _optional(lambda: round(nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, 1)),
                "throttle": [name for bit, name in _REASONS.items() if bits & bit]}
    except Exception as e:  # noqa: BLE001 - a query the driver refuses: say so rather than fail the point
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}


def around_timing(device: torch.device) -> tuple[dict[str, Any], Any]:
    """(the record's `gpu_state` dict, hook(event)): the hook fills "start" / "stop" at the timed region's edges."""
    state: dict[str, Any] = {}
    why = unavailable(device)
    if why is not None:
        state["unavailable"] = why

    def hook(event: str) -> None:
        if why is None and event in ("start", "stop"):
            state[event] = read(device)
    return state, hook

"""moebench.measure.gpu_state: the GPU's clocks, temperature, power and throttle reasons at the timed region's
edges (through NVML, faked here: the CPU machine has none), and compare's clock line from them."""

import sys
import types

import pytest
import torch

from moebench.measure import gpu_state
from moebench.report.compare import clock_line, compare_records


@pytest.fixture
def fake_nvml(monkeypatch):
    calls = []
    nv = types.SimpleNamespace(
        NVML_CLOCK_SM=0, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(i) or ("h", i),
        nvmlDeviceGetClockInfo=lambda h, kind: {0: 1755, 2: 3201}[kind],
        nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980,
        nvmlDeviceGetTemperature=lambda h, kind: 41,
        nvmlDeviceGetPowerUsage=lambda h: 512345,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700000,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4 | 0x1,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(gpu_state, "_NVML", {})
    return calls


def test_read_names_clocks_power_and_throttle_reasons(fake_nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    state = gpu_state.read(torch.device("cuda", 1))
    assert state == {"sm_clock_mhz": 1755, "mem_clock_mhz": 3201, "max_sm_clock_mhz": 1980, "temperature_c": 41,
                     "power_w": 512.3, "power_limit_w": 700.0, "throttle": ["gpu_idle", "sw_power_cap"]}
    assert fake_nvml == [5]  # NVML's own numbering behind CUDA_VISIBLE_DEVICES
    del sys.modules["pynvml"].nvmlDeviceGetEnforcedPowerLimit  # refused on some boards: None, the rest still read
    assert gpu_state.read(torch.device("cuda", 1))["power_limit_w"] is None


def test_around_timing_fills_start_and_stop(fake_nvml):
    state, hook = gpu_state.around_timing(torch.device("cuda", 0))
    hook("start")
    hook("not an edge")
    hook("stop")
    assert set(state) == {"start", "stop"} and state["stop"]["sm_clock_mhz"] == 1755


def test_unavailable_says_why(monkeypatch):
    monkeypatch.setattr(gpu_state, "_NVML", {})
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    state, hook = gpu_state.around_timing(torch.device("cuda", 0))
    hook("start")
    assert "start" not in state and "nvidia-ml-py" in state["unavailable"]
    assert gpu_state.unavailable(torch.device("cpu")) == "not a CUDA device"
    assert gpu_state.read(torch.device("cpu")) is None


def test_a_refused_query_is_reported_not_raised(fake_nvml, monkeypatch):
    def refuse(h, kind):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
    monkeypatch.setattr(sys.modules["pynvml"], "nvmlDeviceGetClockInfo", refuse)
    assert "NOT_SUPPORTED" in gpu_state.read(torch.device("cuda", 0))["error"]


def _rec(key, p50, mhz=None, throttle=()):
    rec = {"key": key, "impl": "i.triton", "params": {}, "status": "ok", "stats": {"p50": p50}}
    if mhz is not None:
        rec["gpu_state"] = {"start": {"sm_clock_mhz": mhz}, "stop": {"sm_clock_mhz": mhz, "throttle": list(throttle)}}
    return rec


def test_compare_clock_line():
    a = [_rec("k1", 10.0, 1980), _rec("k2", 10.0, 1980), _rec("k3", 10.0, 1755, ["gpu_idle"])]
    b = [_rec("k1", 11.0, 1500, ["sw_power_cap"]), _rec("k2", 11.0, 1600), _rec("k3", 11.0, 1700)]
    line = clock_line(compare_records(a, b))
    assert line == ("# SM clock at the end of the timed regions: A median 1980 MHz (range 1755-1980), 0 of 3 points "
                    "throttled; B median 1600 MHz (range 1500-1700), 1 of 3 points throttled")
    assert clock_line(compare_records([_rec("k1", 1.0)], [_rec("k1", 2.0)])) is None  # no state recorded: no line

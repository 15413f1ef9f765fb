"""The roofs a measurement is judged against: one table per device, named in every run's manifest.

A roofline time is max(FLOPs / FLOP roof, bytes / copy roof). The copy and bf16 figures are measured, not
datasheet numbers (docs/hardware.md#roofs): the copy roof is a 1 GiB device-to-device copy counting read + write,
the bf16 roof an 8192^3 torch matmul. The fp8 roof is not measured: it is twice the bf16 figure, Hopper's fp8
tensor-core rate being twice its bf16 rate. Devices not in the table are judged against the H200's figures, and
the manifest names the table used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Roofs:
    name: str
    copy_gbps: float  # device-to-device copy, read + write counted
    bf16_tflops: float  # dense bf16 matmul
    fp8_tflops: float  # dense fp8 e4m3 matmul
    source: str

    def as_dict(self) -> dict:
        return asdict(self)


H200 = Roofs("H200", copy_gbps=4247.0, bf16_tflops=714.0, fp8_tflops=1428.0,
             source="measured on one H200 (docs/hardware.md#roofs): 1 GiB copy, bf16 8192^3 torch matmul; fp8 = 2x bf16, "
                    "not measured")

# Keyed by a substring of torch.cuda.get_device_name().
ROOFS_BY_DEVICE: dict[str, Roofs] = {"H200": H200}
DEFAULT = H200


def roofs_for(device_name: str | None) -> Roofs:
    """The roofs of a device by its name; the H200's (named as the default) for any other device or the CPU."""
    for key, roofs in ROOFS_BY_DEVICE.items():
        if device_name and key in device_name:
            return roofs
    return DEFAULT


def current_roofs() -> Roofs:
    """The roofs of this process's CUDA device (the default when there is none)."""
    try:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # pragma: no cover - a broken driver reads as no device
        name = None
    return roofs_for(name)


def roofline_us(flops: int, bytes_moved: int, roofs: Roofs | None = None, *, fp8: bool = False) -> float:
    """The roofline time in microseconds of `flops` FLOPs and `bytes_moved` bytes on `roofs` (default: here)."""
    r = roofs or current_roofs()
    tflops = r.fp8_tflops if fp8 else r.bf16_tflops
    return max(flops / (tflops * 1e12), bytes_moved / (r.copy_gbps * 1e9)) * 1e6

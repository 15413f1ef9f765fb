"""Comparing an implementation with its reference: exact for integers and bitwise outputs, max/RMS relative
error for floats. Used by the tests and by every Case.check before a point is timed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_SHOW = 5  # mismatches listed in a detail string


@dataclass
class CheckResult:
    """Outcome of comparing an implementation against its reference on the case's inputs."""

    ok: bool
    detail: str = ""  # first mismatches, human readable; empty when ok
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. {"x_q.max_rel": 0.0, "ids.mismatches": 0}

    @staticmethod
    def merge(*results: "CheckResult") -> "CheckResult":
        ok = all(r.ok for r in results)
        detail = "; ".join(r.detail for r in results if r.detail and not r.ok)
        metrics: dict[str, float] = {}
        for r in results:
            metrics.update(r.metrics)
        return CheckResult(ok, detail, metrics)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with a value no correct kernel writes, so an unwritten element shows."""
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.is_floating_point():
        if t.dtype in (torch.float8_e4m3fn, getattr(torch, "float8_e5m2", None)):
            t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
        else:
            t.fill_(float("nan"))
    else:
        t.fill_(-0x5A5A5A5A if t.dtype in (torch.int32, torch.int64) else 0x5A)
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def compare_exact(name: str, out: torch.Tensor, ref: torch.Tensor) -> CheckResult:
    """Bitwise equality (floats compared by their bits, so -0.0 != 0.0 and NaN payloads matter)."""
    if out.shape != ref.shape:
        return CheckResult(False, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}",
                           {f"{name}.mismatches": float("inf")})
    if out.dtype != ref.dtype:
        return CheckResult(False, f"{name}: dtype {out.dtype} != reference {ref.dtype}",
                           {f"{name}.mismatches": float("inf")})
    a, b = _bits(out).cpu(), _bits(ref).cpu()
    diff = a != b
    n = int(diff.sum())
    if n == 0:
        return CheckResult(True, "", {f"{name}.mismatches": 0.0})
    idx = diff.nonzero()[:_SHOW]
    shown = ", ".join(f"{tuple(i.tolist())}: {out.cpu()[tuple(i)].item()} vs {ref.cpu()[tuple(i)].item()}"
                      for i in idx)
    return CheckResult(False, f"{name}: {n}/{diff.numel()} differ, first {shown}", {f"{name}.mismatches": float(n)})


def rel_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max relative error, RMS relative error), both normalised by the reference's max |value| / RMS."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if r.numel() == 0:
        return 0.0, 0.0
    if not torch.isfinite(o).all():
        return float("inf"), float("inf")
    d = o - r
    ref_max = r.abs().max().item() or 1.0
    ref_rms = r.pow(2).mean().sqrt().item() or 1.0
    return d.abs().max().item() / ref_max, d.pow(2).mean().sqrt().item() / ref_rms


def compare_close(name: str, out: torch.Tensor, ref: torch.Tensor, max_rel: float, rms_rel: float) -> CheckResult:
    if out.shape != ref.shape:
        return CheckResult(False, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}",
                           {f"{name}.max_rel": float("inf")})
    mx, rms = rel_errors(out, ref)
    ok = mx <= max_rel and rms <= rms_rel
    detail = "" if ok else f"{name}: max_rel {mx:.3g} (limit {max_rel:g}), rms_rel {rms:.3g} (limit {rms_rel:g})"
    if not ok and out.numel():
        o, r = out.detach().double().cpu(), ref.detach().double().cpu()
        worst = (o - r).abs().nan_to_num(float("inf")).flatten().argmax().item()
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), tuple(out.shape)))
        detail += f", worst at {pos}: {o[pos].item():.6g} vs {r[pos].item():.6g}"
    return CheckResult(ok, detail, {f"{name}.max_rel": mx, f"{name}.rms_rel": rms})

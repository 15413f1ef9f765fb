"""The EP step's wire at a point: the wire model its keys configure (moebench.dispatch.wire_model: the defaults, a
calibration run, the sweep's figures), its phase times, and which cards the step's figures come from: the rank
times from this device, the wire figures from the card of the run the model was calibrated on (a note where the
two differ)."""

from __future__ import annotations

from typing import Callable

import torch

from moebench.bench.serving_trace.knobs import ServingKnobs
from moebench.bench.serving_trace.record import card_note
from moebench.dispatch.wire_model import WireModel, configured_wire_model
from moebench.params import Params

CPU_CARD = "cpu (interpreter)"


def wire_model_of(p: Params) -> WireModel:
    """The wire model of point p (its ServingKnobs' wire keys: moebench.dispatch.wire_model.configured_wire_model)."""
    k = p.knobs(ServingKnobs)
    return configured_wire_model(k.ranks_per_node, k.wire_figures, k.dispatch_calibration, k.wire_path)


def wire_time(model: WireModel) -> Callable[[str, list[list[int]]], float]:
    """(phase "dispatch" | "combine", bytes[src][dst]) -> microseconds under `model`."""
    def wire(phase: str, matrix: list[list[int]]) -> float:
        return float((model.dispatch_us if phase == "dispatch" else model.combine_us)(matrix).us)
    return wire


def rank_card(device: torch.device) -> str:
    """The card the rank times are measured on."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else CPU_CARD


def wire_card(model: WireModel) -> str:
    """Where the wire figures come from: the calibration's cards and run, and any figure the sweep set."""
    said = model.measured_on or model.name
    keyed = sorted(k for k, v in model.source.items() if str(v).startswith("sweep key") and k != "ranks_per_node")
    return said + (f"; set by the sweep: {', '.join(keyed)}" if keyed else "")


def cards(device: torch.device, model: WireModel) -> dict[str, str | None]:
    """The EP-step record's rank_card, wire_card and card_note."""
    card = rank_card(device)
    return {"rank_card": card, "wire_card": wire_card(model),
            "card_note": card_note(card, model.gpu, model.measured_on)}

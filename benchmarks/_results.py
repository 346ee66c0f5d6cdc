"""The one place benchmarks write benchmarks/results/NAME.json (CONVENTIONS.md: figure,
reference, ratio, params, plus any extra fields)."""

from __future__ import annotations

import json
from pathlib import Path


def write_result(name: str, figure, reference, ratio: float, params: dict, **extra) -> Path:
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    record = {"figure": figure, "reference": reference, "ratio": ratio, "params": params, **extra}
    out.write_text(json.dumps(record, indent=2))
    return out

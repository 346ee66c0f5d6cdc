"""Makes the checkout's root importable for a benchmark run as a script (`python
benchmarks/NAME.py` puts only benchmarks/ on sys.path). The benchmarks that drive the tiny CPU
stack, a live critic or a vLLM worker without a server use the helpers of tests/support, which
are not installed with the package. Import it before them: `import _checkout  # noqa: F401`."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)

"""The real worker extension with what it holds during a path (b) update measured from outside,
for tests against real vLLM servers.

`measured_server(model_dir, port, log_path, **kwargs)` starts a vLLM server with the package's own
command line (`vllm_command`) but `MeasuredReceiverExtension` in place of the package's extension,
through `VllmServer(command=)`: the seam a user's wrapper command uses. The measured
extension runs the package's `receive_weights` unchanged, with the weight stream it consumes
wrapped by `ReceivedAllocations` (tests/support/memory.py): every storage created while vLLM
waits for the next tensor (plans, buckets, copies) counts from its creation until it is freed,
whoever frees it. `get_weight_update_memory` (a collective_rpc method) returns the last update's
figures: `tensors`, `received_bytes` (the tensors' bytes), `peak_held_bytes` and `held_now_bytes`.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron_rl.inference import vllm_extension
from megatron_rl.inference.vllm_server import EXTENSION, VllmServer, vllm_command
from tests.support.memory import ReceivedAllocations


class MeasuredReceiverExtension(vllm_extension.WeightReceiverExtension):
    _last_update: dict | None = None

    def receive_weights(self, version: int) -> int:
        stream, arrived = vllm_extension.receive_weight_stream, []
        with ReceivedAllocations() as held:
            vllm_extension.receive_weight_stream = lambda *a, **k: held.iterate(stream(*a, **k), arrived)
            try:
                count = super().receive_weights(version)
            finally:
                vllm_extension.receive_weight_stream = stream
        # gloo's worker thread lets go of the last broadcast's tensor a moment after the broadcast
        # returned: what vLLM keeps is what is still alive a while later.
        deadline = time.monotonic() + 2.0
        while held.current and time.monotonic() < deadline:
            time.sleep(0.01)
        self._last_update = {
            "tensors": len(arrived), "received_bytes": sum(size for _, size in arrived),
            "peak_held_bytes": held.peak, "held_now_bytes": held.current,
        }  # fmt: skip
        return count

    def get_weight_update_memory(self) -> dict | None:
        return self._last_update


def measured_server(model_dir, port: int, log_path: Path, **kwargs) -> VllmServer:
    """A started vLLM server (the package's command line) whose worker extension is measured."""
    command = vllm_command(model_dir, port, **kwargs).argv
    command[command.index(EXTENSION)] = f"{__name__}.{MeasuredReceiverExtension.__name__}"
    return VllmServer(model_dir, port, log_path, command=command, **kwargs)

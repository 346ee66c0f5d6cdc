"""HTTP control of a vLLM OpenAI server for weight updates (dev-mode endpoints).

`VllmControl(base_url)`: `pause()`, `resume()`, `reset_prefix_cache()`, `reload_weights(dir)`
and `collective_rpc(method, kwargs)` (which calls a method of every worker of that server,
e.g. of megatron_rl.inference.vllm_extension.WeightReceiverExtension). The server must run with
`VLLM_SERVER_DEV_MODE=1`. Plain urllib (no event loop), so trainer threads can call it; every
error names the URL. Arguments travel as JSON, never pickle.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class VllmControlError(RuntimeError):
    pass


class VllmControl:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict | None = None):
        url = f"{self.base_url}{path}"
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(
            url, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            raise VllmControlError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise VllmControlError(f"{url}: {exc}") from None
        try:
            return json.loads(payload) if payload else None
        except json.JSONDecodeError:
            return payload.decode(errors="replace")

    def pause(self):
        return self._post("/pause")

    def resume(self):
        return self._post("/resume")

    def reset_prefix_cache(self):
        return self._post("/reset_prefix_cache")

    def collective_rpc(self, method: str, kwargs: dict | None = None):
        return self._post("/collective_rpc", {"method": method, "kwargs": kwargs or {}})

    def reload_weights(self, weights_dir: str):
        """Path (a): every worker loads the HF safetensors in `weights_dir`."""
        return self.collective_rpc("reload_weights", {"weights_path": str(weights_dir)})

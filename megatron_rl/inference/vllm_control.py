"""Admin control of one vLLM OpenAI server (dev-mode endpoints), straight to the server.

`VllmControl(base_url)`: `pause(mode)` (`keep`: requests in flight are held and continue after
`resume()`; `abort`: they end with the tokens so far; the caches cleared either way), `resume()`,
`is_paused()`, `reset_prefix_cache()` (checked: an error unless the server emptied it),
`reload_weights(dir)`, `collective_rpc(method, kwargs)` (calls a method of every worker of that
server, e.g. of `megatron_rl.inference.vllm_extension.WeightReceiverExtension`), `models()`,
`load_adapter_version(name, dir, version)` (a LoRA adapter in PEFT's format, by vLLM's
`/v1/load_lora_adapter`: the server runs with LoRA enabled and runtime LoRA updating).
The server must run with `VLLM_SERVER_DEV_MODE=1`. Synchronous (httpx), so trainer threads can
call it. Idempotent calls are retried with exponential backoff on connection errors and 5xx
replies; a collective_rpc is not (it may be one half of a collective). Every error names the
URL. Arguments travel as JSON, never pickle. These endpoints can run methods inside the server:
inference servers must listen on a cluster-internal address only.
"""

from __future__ import annotations

import time

import httpx


class VllmControlError(RuntimeError):
    pass


class VllmControl:
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _request(self, method: str, path: str, body: dict | None = None, retry: bool = True, timeout_s=None):
        url = f"{self.base_url}{path}"
        attempts = self.retries + 1 if retry else 1
        delay = self.backoff_s
        for attempt in range(attempts):
            try:
                response = httpx.request(
                    method, url, json=body, headers=self.headers, timeout=timeout_s or self.timeout_s
                )
            except httpx.HTTPError as exc:
                error = VllmControlError(f"{url}: {type(exc).__name__}: {exc}")
            else:
                if response.status_code < 400:
                    try:
                        return response.json() if response.content else None
                    except ValueError:
                        return response.text
                error = VllmControlError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
                if response.status_code < 500:
                    raise error
            if attempt + 1 < attempts:
                time.sleep(delay)
                delay *= 2
        raise error

    def pause(self, mode: str = "keep", clear_cache: bool = True):
        """`keep`: requests in flight are preempted and held, and finish after `resume()` under the
        weights loaded meanwhile; `abort`: they end now with finish reason `abort` and the tokens
        sampled so far (the rollout client resumes them). `clear_cache`: vLLM empties its KV and
        prefix caches once paused, which re-prefills a held request from its first token (sent,
        not left to the server's default)."""
        return self._request("POST", f"/pause?mode={mode}&clear_cache={'true' if clear_cache else 'false'}")

    def resume(self):
        return self._request("POST", "/resume")

    def is_paused(self) -> bool:
        reply = self._request("GET", "/is_paused")
        return bool(reply.get("is_paused")) if isinstance(reply, dict) else bool(reply)

    def reset_prefix_cache(self):
        """Empties the server's prefix cache, so no request reuses KV computed under the previous
        weights; a VllmControlError naming the server unless it replies that it did
        (`{"success": true}`: vLLM declines while blocks are held)."""
        reply = self._request("POST", "/reset_prefix_cache")
        if not (isinstance(reply, dict) and reply.get("success") is True):
            raise VllmControlError(
                f"{self.base_url}/reset_prefix_cache: the prefix cache was not emptied (reply {reply!r}); requests "
                "could reuse KV of the previous weights"
            )
        return reply

    def models(self, timeout_s: float = 5.0) -> list[str]:
        """The served model names (`GET /v1/models`), without retries (a readiness probe)."""
        reply = self._request("GET", "/v1/models", retry=False, timeout_s=timeout_s)
        return [entry["id"] for entry in reply.get("data", [])]

    def collective_rpc(self, method: str, kwargs: dict | None = None, retry: bool = False):
        reply = self._request(
            "POST", "/collective_rpc", {"method": method, "kwargs": kwargs or {}}, retry=retry
        )
        return reply.get("results", reply) if isinstance(reply, dict) else reply

    def reload_weights(self, weights_dir: str):
        """Path (a): every worker loads the HF safetensors in `weights_dir`."""
        return self.collective_rpc("reload_weights", {"weights_path": str(weights_dir)}, retry=True)

    def load_version(self, weights_dir: str, version: int):
        """Path (a) through our worker extension: loads `weights_dir` and records `version`."""
        return self.collective_rpc(
            "load_published_version", {"weights_path": str(weights_dir), "version": version}, retry=True
        )

    def load_adapter_version(self, name: str, adapter_dir: str, version: int):
        """A LoRA policy's adapter-only update: the server loads the PEFT adapter in `adapter_dir`
        under `name` (in place when it has one of that name: the same LoRA slot, requests naming
        it get the new weights) and its workers record `version`."""
        self._request("POST", "/v1/load_lora_adapter",
                      {"lora_name": name, "lora_path": str(adapter_dir), "load_inplace": True})  # fmt: skip
        return self.collective_rpc("set_weights_version", {"version": int(version)}, retry=True)

    def weights_version(self) -> int:
        """The policy version the server's workers run (the lowest over its workers)."""
        results = self.collective_rpc("get_weights_version", retry=True)
        values = results if isinstance(results, list) else [results]
        return min(int(v) for v in values)

"""The scale simulator: the real orchestrator against inference servers, a critic and a policy
that spend simulated time on a virtual clock (`benchmarks/scale.py`, docs/scale.md).

- `cluster`: `SimCluster` (the stand-ins and the run), `cluster_config`, `steady_step_s`;
- `inference`: the inference servers' stand-in (`SimInference`, the rollout client's place):
  slots and queues, weight updates under `inference.update_mode` keep or interrupt (partial
  rollouts), busy time and tokens re-prefilled;
- `models`: the timing models (`ClusterModel`, FLOPs of a configured layout) and the stand-in
  tokenizer and environment;
- `transport`: each model's real ZMQ GridSender with real GridReceivers on loopback;
- `virtual_clock`: the asyncio loop whose clock jumps to the next timer.
"""

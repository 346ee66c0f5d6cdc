"""The critic: a Megatron value model on its own ranks behind an HTTP scoring service.

scoring.py   the collective batched scoring pass (every critic rank)
service.py   aiohttp service on critic rank 0: /score, /status, /health, request validation
trainer.py   CriticTrainer: K epochs per step, head-only phases, LoRA, freezing,
             pretraining, policy snapshots, checkpoints
loss.py      the value loss and its batch (`value_loss_func`, `CriticBatch`)
worker.py    `megatron-rl critic`: the command loop that ties them together
client.py    HttpValueScorer, the orchestrator's ValueScorer over HTTP
pretrain.py  the value-pretraining JSONL reader

The service's parts are shared with the Megatron teacher (megatron_rl/teacher/): scoring.py's
`per_token_outputs` pass, service.py's `ModelService` (validation, queue, merged requests,
/status, /health), worker.py's `ServingLoop` (the IDLE/SCORE/STOP command loop), client.py's
`ServiceClient` (retries, timeouts) and wire.py's `encode_rows` / `decode_rows`.
"""

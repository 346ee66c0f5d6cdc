"""The critic: a Megatron value model on its own ranks behind an HTTP scoring service.

scoring.py   the collective batched scoring pass (every critic rank)
service.py   aiohttp service on critic rank 0: /score, /status, /health, request validation
trainer.py   CriticTrainer: K epochs per step, head-only phases, LoRA, freezing,
             pretraining, policy snapshots, checkpoints
loss.py      the value loss and its batch (`value_loss_func`, `CriticBatch`)
worker.py    `megatron-rl critic`: the command loop that ties them together
client.py    HttpValueScorer, the orchestrator's ValueScorer over HTTP
pretrain.py  the value-pretraining JSONL reader
"""

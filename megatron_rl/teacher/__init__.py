"""The Megatron teacher of on-policy distillation: for a teacher vLLM cannot serve, the teacher's
HF weights (`distillation.teacher.model_dir`) in a Megatron GPT model on a layout of its own
(`distillation.teacher.megatron`: tp, cp, pp, ep, replicas), forward-only, behind an HTTP service
on its rank 0 (docs/teacher-api.md).

scoring.py   the collective passes: each token's log-probability given the tokens before it
             (the policy's `forward_logprobs`), and with a request's top_k each position's k
             most likely tokens too (`score_top_k`), vocab-parallel, packed and batched as the
             critic's scoring is (critic/scoring.py `per_token_outputs`)
service.py   `TeacherService`: POST /logprobs (top_k optional), /status, /health
             (critic/service.py's `ModelService`: validation, queue, merged requests answered
             with their own rows)
worker.py    `megatron-rl teacher --config RESOLVED.json` under torchrun: the model, its
             loaded weights and the serving loop (critic/worker.py's `ServingLoop`)
client.py    `MegatronTeacher`, the orchestrator's TeacherScorer over the service
"""

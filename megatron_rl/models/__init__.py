"""Building and running a Megatron model: `builder` (GPT models from an `Architecture`, the layer
spec, TE or local), `value_model` (the critic's value head), `attention` (packed and Ulysses core
attention), `logprobs` (the chunked vocabulary-parallel log-prob kernel), `sharding` (full
tensors across TP/EP/PP ranks, global names), `tiny` and `chat_templates` (the random models and
tokenizers of the tests and the demo). HF conversion and checkpoint formats: `conversion/`; what
wraps a built model (LoRA, routing replay): `transforms/`."""

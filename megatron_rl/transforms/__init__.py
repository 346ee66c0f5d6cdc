"""What wraps a built model: `lora` (adapters on megatron's linears, merged weights, adapters off),
`peft` (adapters in PEFT's format), `lora_base` (a LoRA checkpoint's base identity, which every
save and resume checks), `lora_export` (the export tool: PEFT or merged HF weights of a step),
`routing` (MoE routing replay and router health)."""

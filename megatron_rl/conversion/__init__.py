"""HF <-> Megatron conversion and checkpoint formats: `hf_mapping` (one declarative mapping per
model family and the named fuse/split transforms), `convert` (a converted checkpoint written and
read back, layer by layer, either layer spec), `checkpoint_io` (safetensors shards, meta.json, HF
side files), `spec_keys` (the TE and local specs' checkpoint keys, mapped both ways). Training
checkpoints (model, optimizer, RNG) are trainer/checkpoint.py's."""

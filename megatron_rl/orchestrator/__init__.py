"""The orchestrator (megatron-rl orchestrate): environments -> rollouts -> TrainSink -> scoring -> two grids -> weights."""

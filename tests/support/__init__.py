"""What the tests share and the package does not ship (not installed): spawning gloo ranks,
starting a role's ranks as processes, config builders, sample factories, shared rank functions,
a live CPU critic, the tiny CPU stack, stand-ins (a fake vLLM server, vLLM workers without a
server, TransformerEngine modules, host-offload emulation), orchestrator fakes, recorders, a
local SLURM. The GPU checks (tests/gpu) and a few benchmarks import them too."""

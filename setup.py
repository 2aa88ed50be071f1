"""Packaging for rl_fusion_jax."""

import setuptools

setuptools.setup(
    name="rl_fusion_jax",
    version="0.1.0",
    description="JAX-native RL post-training of LLMs (GRPO, PPO) with co-located training and generation.",
    packages=setuptools.find_packages(include=["rl_fusion_jax", "rl_fusion_jax.*"]),
    package_data={"rl_fusion_jax": ["testing/*.jsonl", "testing/hf_fixtures/*/*"]},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "chex>=0.1.92",
        "absl-py>=2.1",
        "ml-collections>=1.1.0",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "jinja2>=3.1",  # chat templates (rl_fusion_jax/chat.py), rendered as transformers does
        "numpy>=1.26",
        "jaxtyping>=0.2.36",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "matplotlib>=3.8"],
        # Reference fixtures only (experiments/make_hf_fixtures.py); never imported by the package.
        "fixtures": ["torch>=2.3", "transformers>=4.45"],
        "tensorboard": ["tensorboardX>=2.6"],
        "plot": ["matplotlib>=3.8"],
        # The TRL side of experiments/benchmark_vs_trl.py (experiments/trl_tiny_grpo.py), in its own
        # environment; the versions it was measured with are in BENCHMARKS.md.
        "trl_bench": ["torch>=2.13", "transformers>=5.24", "trl>=1.16", "datasets>=5.2", "accelerate>=1.15"],
    },
)

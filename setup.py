from setuptools import find_packages, setup

setup(
    name="megatron_rl_bi",
    version="0.1.0",
    description="GRPO/DAPO on megatron-core with bitwise trainer/generator logprob parity",
    packages=find_packages(include=["megatron_rl_bi", "megatron_rl_bi.*"]),
    python_requires=">=3.12",
    install_requires=[
        "megatron-core==0.19.2",
        # fla's kernels (fla.ops, fla.modules). Not flash-linear-attention, fla's layers and models:
        # nothing here uses them, and with them installed every import of fla imports them too
        # (1.4 s a process here, 13 s on the H100 without bytecode).
        "fla-core==0.6.0",
        "torch>=2.8",
        "einops",
        "numpy",
        "pyyaml",
        # Hugging Face checkpoints and tokenizers (Qwen3.5 needs transformers 5).
        "transformers>=5.0",
        "safetensors",
        # megatron-core's dist-checkpoint writer starts its worker with psutil.
        "psutil",
        # BM25 of the built-in search environment (numpy only).
        "bm25s>=0.2",
    ],
    extras_require={
        # FlashAttention-4 (CuTe DSL) runs on Hopper and Blackwell; FA3 is a source build
        # (flash_attn_3 from the hopper/ folder of flash-attention) and has no extra here.
        "fa4": ["flash-attn-4==4.0.0b36"],
        "te": ["transformer-engine[pytorch]"],
        "test": ["pytest"],
        "plot": ["matplotlib"],
    },
)

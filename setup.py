from setuptools import find_packages, setup

setup(
    name="megatron-tsp",
    version="0.1.0",
    description="TSP (Tensor + Sequence Parallelism) as a parallel dimension for Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_tsp", "megatron_tsp.*"]),
    python_requires=">=3.10",
    # torch: any build >= 2.6 (CUDA, ROCm or CPU) that the user installed; we never pin one.
    # psutil: megatron-core's dist_checkpointing writer needs it and does not declare it.
    install_requires=["megatron-core>=0.16,<0.17", "torch>=2.6", "pyyaml", "psutil"],
    extras_require={
        "test": ["pytest"],
        "plot": ["matplotlib"],
        # Optional acceleration on NVIDIA GPUs, detected at run time.
        "te": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["megatron-tsp=megatron_tsp.cli:main"]},
)

from setuptools import find_packages, setup

setup(
    name="nxdi_voxtral",
    version="0.1.0",
    description="Voxtral-Mini-3B as fixed-shape graphs for AWS Trainium2 (NxD Inference / TorchNeuron) "
                "with exact speculative decoding; every graph also runs and is tested on CPU.",
    python_requires=">=3.10",
    # one import root: everything installs under nxdi_voxtral (generic top-level names such as `kernels` belong to
    # other PyPI packages); the checkout's compile/ and artifacts/ are entry shims for `python -m compile.build` /
    # `python -m artifacts`, and an install gets the console scripts below instead
    packages=find_packages(include=["nxdi_voxtral", "nxdi_voxtral.*"]),
    package_data={"nxdi_voxtral": ["csrc/*.c"]},
    entry_points={"console_scripts": ["nxdi-voxtral = nxdi_voxtral.__main__:main",
                                      "nxdi-voxtral-build = nxdi_voxtral.build:main",
                                      "nxdi-voxtral-artifacts = nxdi_voxtral.release:main"]},
    install_requires=[
        # satisfied by the CPU torch 2.13 wheel; install torch first so pip does not pull a CUDA build
        "torch>=2.9,<2.15",
        "transformers>=4.56,<6",
        "mistral-common[audio]>=1.8,<2",
        "safetensors>=0.4",
        "numpy>=1.24",
        # `python -m nxdi_voxtral serve`
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "python-multipart>=0.0.9",
        "prometheus-client>=0.17",
    ],
    extras_require={
        "test": ["pytest>=7", "httpx>=0.27", "openai>=1.30", "kubernetes-validate>=1.28", "pyyaml>=6"],
        # trn2 stack: from AWS's Neuron package repository (PyPI only has placeholders), see README
        "trn2": [],
    },
)

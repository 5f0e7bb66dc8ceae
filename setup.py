"""tfpar: parallel and distributed training of Keras 3 models on TensorFlow 2."""

from setuptools import find_packages, setup

# Pinned to the versions the test suite runs against; see BUILD_NOTES.md for why.
INSTALL_REQUIRES = [
    "tensorflow==2.21.0",
    "keras==3.15.1",
    "tensorflow-datasets==4.9.10",
    "tensorboard==2.21.0",  # TF 2.21 no longer pulls it in; Keras TensorBoard callback needs it
    "absl-py>=2.1,<3",
    "numpy>=1.26,<3",
]

setup(
    name="tfpar",
    version="0.1.0",
    description="Parallel and distributed training of Keras 3 models on TensorFlow 2.",
    packages=find_packages(include=["tfpar", "tfpar.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    # keras-hub: real model configs (GemmaBackbone.get_layout_map) for keras.distribution tests.
    extras_require={"test": ["pytest>=8,<10", "pytest-timeout>=2.3", "pytest-xdist>=3.5,<4",
                             "keras-hub==0.32.0"]},
    entry_points={"console_scripts": ["tfpar=tfpar.cli:main"]},
)

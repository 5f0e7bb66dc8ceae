"""tfpar: parallel and distributed training of Keras 3 models on TensorFlow 2."""

from setuptools import find_packages, setup

# Ranges tested at both ends (BUILD_NOTES.md, .ci/run): a plugin keeps the user's own
# TensorFlow and Keras. Keep them in step with tfpar.keras.internals.TESTED_WITH.
INSTALL_REQUIRES = [
    "tensorflow>=2.19,<2.22",
    "keras>=3.10,<3.16",
    "tensorflow-datasets>=4.9.8,<5",
    "tensorboard>=2.19,<2.22",  # TF 2.21 no longer pulls it in; Keras TensorBoard callback needs it
    "absl-py>=2.1,<3",
    # PipelineStrategy.trace draws its timeline PNG (tfpar.viz); TensorBoard 2.20+ pulls
    # Pillow in, 2.19 does not.
    "pillow>=9.2,<14",
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
                             "keras-hub==0.32.0",
                             # The documentation site (docs/), built and its snippets run by
                             # tests/docs/test_docs.py.
                             "mkdocs>=1.6,<2", "mkdocstrings[python]>=1.0,<2"]},
    entry_points={"console_scripts": ["tfpar=tfpar.cli:main"]},
)

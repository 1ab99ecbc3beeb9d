"""Launcher that forms a multi-node inference unit and runs vLLM on Neuron."""

# The package version (pyproject.toml's, checked by its tests); `--version` prints it.
__version__ = "0.1.0"

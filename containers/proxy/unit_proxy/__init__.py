"""Streaming reverse proxy beside each unit leader: health, load, admission, drain."""

# The package version (pyproject.toml's, checked by its tests); `--version` prints it.
__version__ = "0.1.0"

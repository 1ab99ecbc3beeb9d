"""Launcher that forms a multi-node inference unit and runs vLLM on Neuron."""

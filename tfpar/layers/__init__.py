"""Keras layers for placing models on devices."""

from tfpar.layers.on_device import OnDevice

__all__ = ["OnDevice"]

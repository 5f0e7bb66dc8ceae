"""Keras layers for placing models on devices."""

from tfpar.layers.on_device import OnDevice
from tfpar.layers.stage_boundary import StageBoundary

__all__ = ["OnDevice", "StageBoundary"]

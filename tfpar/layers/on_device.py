"""`OnDevice`: a Keras layer that pins one wrapped layer to a device."""

import contextlib
import warnings

import keras

from tfpar import devices as devices_lib
from tfpar.distribute.common import placed_call as placement
from tfpar.errors import DeviceError
from tfpar.keras import models


@keras.saving.register_keras_serializable(package="tfpar")
class OnDevice(keras.layers.Wrapper):
    """Pins `layer` to `device`: its variables, its forward and its backward.

    For placing layers by hand, e.g. in a functional model. Works with or without
    a strategy. Saved models keep the device name; loading on a host without that
    device warns and runs the layer on the default device instead. Loading a saved
    model needs `tfpar.layers` imported (or `custom_objects={"OnDevice": OnDevice}`).

    Args:
      layer: the `keras.layers.Layer` to pin.
      device: a device of this host, e.g. "/cpu:1" or "/gpu:0".

    Raises:
      DeviceError: `device` is malformed or does not exist.

    Examples:
      >>> import keras, tfpar
      >>> inputs = keras.Input((4,))
      >>> hidden = tfpar.layers.OnDevice(keras.layers.Dense(8), "/cpu:0")(inputs)
      >>> outputs = tfpar.layers.OnDevice(keras.layers.Dense(3), "/cpu:0")(hidden)
      >>> model = keras.Model(inputs, outputs)
      >>> model.layers[1].layer.kernel.value.device
      '/job:localhost/replica:0/task:0/device:CPU:0'
    """

    _tfpar_pins_device = True  # Read by the Keras seam (a pipeline's stages), which does
    # not import this runtime-bound layer.

    def __init__(self, layer, device, **kwargs):
        missing_device = kwargs.pop("_missing_device", "raise")
        super().__init__(layer, **kwargs)
        self.device = device
        try:
            self._device = devices_lib.resolve_devices([device])[0]
        except DeviceError as error:
            if missing_device == "raise" or not isinstance(device, str):
                raise
            warnings.warn(f"OnDevice({layer.name!r}): {error} The layer runs on the default "
                          f"device.")
            self._device = None
        self.supports_masking = getattr(layer, "supports_masking", False)

    def build(self, input_shape=None):
        # Variables are created where the layer will run; those of a layer built
        # before it was wrapped (or while being loaded) are moved there.
        with self._on_device():
            super().build(input_shape)
            if self._device:
                for variable in self.layer.variables:
                    placement.move_variable(variable, self._device)

    def _on_device(self):
        return placement.variable_device(self._device) if self._device else (
            contextlib.nullcontext())

    def call(self, inputs, training=None, mask=None):
        kwargs = {}
        if models.call_takes_training(self.layer):
            kwargs["training"] = training
        if mask is not None and models.call_takes_mask(self.layer):
            kwargs["mask"] = mask
        return placement.placed_call(self.layer, self._device, inputs, **kwargs)

    @property
    def pinned_device(self):
        """The canonical device the layer runs on, or None (device missing here)."""
        return self._device

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def compute_mask(self, inputs, mask=None):
        return self.layer.compute_mask(inputs, mask)

    def get_config(self):
        return {**super().get_config(), "device": self.device}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        layer = keras.saving.deserialize_keras_object(config.pop("layer"),
                                                      custom_objects=custom_objects)
        return cls(layer, _missing_device="warn", **config)


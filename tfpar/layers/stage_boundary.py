"""`StageBoundary`: an identity layer marking where a pipeline stage starts."""

import keras


@keras.saving.register_keras_serializable(package="tfpar")
class StageBoundary(keras.layers.Layer):
    """Marks where a new pipeline stage starts; computes nothing.

    Under `tfpar.PipelineStrategy`, a model with K-1 markers is cut into K stages,
    each starting at a marker (the marker runs in the stage it starts). Without
    markers the strategy cuts the model into balanced stages itself. Anywhere
    else the layer is the identity, so a model with markers trains, saves and
    loads as usual. In a functional model a marker must sit where exactly one
    activation crosses from the layers before it to the layers after it (the model's
    own inputs, such as a padding mask, may cross with it).

    Examples:
      >>> import keras, tfpar
      >>> model = keras.Sequential([
      ...     keras.Input((4,)),
      ...     keras.layers.Dense(8, activation="relu"),
      ...     tfpar.layers.StageBoundary(),        # stage 1 starts here
      ...     keras.layers.Dense(3),
      ... ])
      >>> [type(layer).__name__ for layer in model.layers]
      ['Dense', 'StageBoundary', 'Dense']
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.built = True

    def call(self, inputs):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape

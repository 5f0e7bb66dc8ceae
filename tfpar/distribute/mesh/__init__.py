"""`keras.distribution` on TensorFlow's DTensor (the TensorFlow side) and `MeshStrategy`."""

"""Pure planning logic: plain Python, never imports TensorFlow."""

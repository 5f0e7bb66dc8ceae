"""TensorFlow glue: strategies that execute tfpar's plans."""

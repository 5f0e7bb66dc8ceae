"""The Keras seam: the one package where tfpar adapts Keras 3 (and reads its internals).

- `hooks.py`: the few Keras methods tfpar wraps (model call, train step, file-writing
  callbacks), each once, each asking the model's strategy what to do;
- `parameter_server.py`: `fit`/`evaluate`/`predict` on a parameter-server cluster;
- `internals.py`: every Keras and TensorFlow private that tfpar touches, read through
  accessors that fail closed with the pinned versions named.

Nothing here runs at import: strategies install the hooks they need.
"""

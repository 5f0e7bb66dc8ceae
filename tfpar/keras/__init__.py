"""The Keras seam: the one package where tfpar adapts Keras 3 (and reads its internals).

- `hooks.py`: the few Keras methods tfpar wraps (model call, train step, file-writing
  callbacks), each once, each asking the model's strategy what to do;
- `replicas.py`: Keras' loss normalization, BatchNorm statistics, gradient accumulation
  and call losses made exact under replicas; refusals before a step is built;
- `steps.py`: pieces of Keras' train step that tfpar's own steps share;
- `xla_calls.py`: `jit_compile=True` under a strategy: each replica's model call (or each
  placed layer's) compiled by XLA as a stateless call of the variables' values;
- `models.py`: Keras models, layers and variables as the strategies see them (what is a
  model, the layers a model is placed by, a layer's call shapes, a build from shapes);
- `pipeline_stages.py`: a functional or Sequential model cut into pipeline stages, each run by
  Keras' own graph runner;
- `ps_adapters.py`: what the parameter-server strategy's own `fit`/`evaluate`/`predict`
  loops need of Keras (data adapters, callbacks, steps, metrics), and those methods routed
  to them;
- `tf_runtime.py`, `tf_variables.py`, `tf_coordinator.py`: TensorFlow's distribution
  runtime (extended classes and their state, collectives, devices, the eager context),
  its variables' copies, the parameter-server coordinator, as the strategies use them;
- `internals.py`: every Keras and TensorFlow private that tfpar touches, read through
  accessors that fail closed with the pinned versions named. Outside this package tfpar
  names no private: the runtime calls the functions above (`tests/test_layout.py`).

Nothing here runs at import: strategies install the hooks they need.
"""

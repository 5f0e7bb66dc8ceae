"""Running a callable on one device, forward *and* backward.

`placed_call(fn, device, *args, **kwargs)` is the one building block of model
parallelism: `ModelParallelStrategy` wraps each layer's `call` with it, `OnDevice`
calls it, and the pipeline runs its stages through it.

Why a custom gradient: `tf.device` only places the ops built inside it. On TF 2.21
the gradient ops that `GradientTape` builds inside a `tf.function` carry no
device, so the whole backward pass lands on the default device. Here the forward
runs under `tf.device(device)` on a tape of its own, inside `tf.custom_gradient`;
when an outer tape (Keras `fit`, or a user's loop) reaches this call, the gradient
function builds the vector-Jacobian product from that tape, again under
`tf.device(device)`, so every backward op is built with the device. The forward
is not recomputed. The same holds in eager mode.

Limits: a loss that `fn` adds on the side (Keras `add_loss` inside `call`) is not an
output, so its gradient reaches `fn`'s inputs and variables through the outer tape,
correctly but unplaced. Non-float inputs (ids, masks) get no gradient.

Variables: ops that read a variable run where the variable lives, so a layer's
variables must be created on its device too. `variable_device(device)` names the
device on which tfpar's placing strategies create variables meanwhile (see
`tfpar.keras.variable_birth`), and `move_variable` puts a Keras variable's storage on a
device.
"""

import contextlib

import tensorflow as tf

from tfpar.keras import models
from tfpar.keras import tf_runtime
from tfpar.keras import tf_variables
from tfpar.keras import variable_birth


@contextlib.contextmanager
def variable_device(device):
    """Ops, and variables created by tfpar's placing strategies, go to `device` meanwhile
    (every copy of a pipeline's mirrored variables too)."""
    with variable_birth.variable_home((device,)), tf.device(device):
        yield


def canonical_device(device):
    """'/cpu:1' -> '/job:localhost/replica:0/task:0/device:CPU:1'; None stays None."""
    return None if device is None else tf_runtime.canonical_device(device)


def move_variable(variable, device):
    """Moves a Keras variable's storage to `device`, keeping its value and identity.

    The `keras.Variable` object stays the same (layers, optimizers and
    checkpoints refer to it); the `tf.Variable` inside it is replaced by a copy
    on `device`. The copy keeps the old `_unique_id`, which is what Keras'
    TensorFlow optimizer keys its per-variable state by. Returns True if moved.
    A variable without storage yet (`variable_birth.has_no_storage`) gets it on
    `device`: nothing moves.

    Call it before the variable is captured by a traced `tf.function`: traces
    made before keep reading the old copy. Variables of a distribution strategy
    (e.g. mirrored on every replica) are left where the strategy put them.
    """
    if variable_birth.has_no_storage(variable):
        variable_birth.materialize(variable, (canonical_device(device),))
        return False
    old = models.storage(variable)
    if (isinstance(old, tf.distribute.DistributedValues)
            or canonical_device(old.device) == canonical_device(device)):
        return False
    with tf.init_scope(), variable_device(device):
        new = tf.Variable(
            old.read_value(), trainable=old.trainable, name=old.name.split(":")[0],
            dtype=old.dtype, aggregation=old.aggregation,
            synchronization=old.synchronization, shape=old.shape)
    tf_variables.stand_in(new, old)
    models.set_storage(variable, new)
    return True


def _in_keras_symbolic_scope():
    # Keras traces layers on symbolic inputs to infer shapes; nothing runs there.
    return models.in_symbolic_scope()


def _tape_recording():
    return tf_runtime.tape_recording()


def _differentiable(x):
    return isinstance(x, tf.Tensor) and (x.dtype.is_floating or x.dtype.is_complex)


def placed_call(fn, device, *args, **kwargs):
    """Calls `fn(*args, **kwargs)` on `device`, and builds its gradient there too.

    Floating-point tensors among `args`/`kwargs` (nested structures allowed) are
    differentiable inputs; everything else (ints, Python values, masks) passes
    through unchanged. Trainable variables that `fn` reads get gradients, as with
    any TensorFlow code.

    Args:
      fn: the callable, e.g. a Keras layer (its `__call__` runs on `device`).
      device: a device string, or None to just call `fn`.

    Returns:
      What `fn` returns.

    Examples:
      >>> import tensorflow as tf
      >>> w = tf.Variable(2.0)
      >>> x = tf.constant(3.0)
      >>> with tf.GradientTape() as tape:
      ...     tape.watch(x)
      ...     y = placed_call(lambda t: t * w, "/cpu:0", x)
      >>> [float(g) for g in tape.gradient(y, [x, w])]
      [2.0, 3.0]
    """
    return placed(fn, device, args, kwargs)


def placed(fn, device, args, kwargs, keep_variable=None):
    """`placed_call(fn, device, *args, **kwargs)`; `keep_variable(variable)` False: the
    variable's gradient through this call is left out (None), for a computation repeated
    on several devices whose gradients are equal (a replicated block's layer norms): one
    copy of the repeat gives the whole gradient."""
    if device is None or _in_keras_symbolic_scope():
        return fn(*args, **kwargs)
    if tf.executing_eagerly() and not _tape_recording():
        # Eager inference: there is no backward to place.
        with tf.device(device):
            return fn(*args, **kwargs)

    flat = tf.nest.flatten((args, kwargs))
    # One input per distinct tensor: a tensor passed twice (an attention's query and value)
    # is one source of the tape, whose gradient already sums both uses.
    inputs_at = {}  # id(tensor) -> the positions it fills.
    for i, x in enumerate(flat):
        if _differentiable(x):
            inputs_at.setdefault(id(x), []).append(i)
    distinct = [flat[positions[0]] for positions in inputs_at.values()]
    structure = {}

    def forward(*inputs):
        leaves = list(flat)
        for positions, tensor in zip(inputs_at.values(), inputs):
            for i in positions:
                leaves[i] = tensor
        call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), leaves)
        # Persistent: an outer persistent tape may ask for this gradient twice.
        tape = tf.GradientTape(persistent=True)
        with tape:
            tape.watch(inputs)
            outputs = fn(*call_args, **call_kwargs)
        flat_out = tf.nest.flatten(outputs)
        structure["outputs"] = outputs
        structure["tensors_at"] = [i for i, o in enumerate(flat_out) if isinstance(o, tf.Tensor)]
        results = [flat_out[i] for i in structure["tensors_at"]]

        def gradient(*upstream, variables=None):
            sources = list(inputs) + list(variables or ())
            # Outputs that received no gradient are left out, not seeded with ones.
            used = [(r, u) for r, u in zip(results, upstream)
                    if u is not None and _differentiable(r)]
            if used and sources:
                with tf.device(device):
                    grads = tape.gradient([r for r, _ in used], sources,
                                          output_gradients=[u for _, u in used])
            else:
                grads = [None] * len(sources)
            input_grads = list(grads[:len(inputs)])
            if variables is None:
                return input_grads
            variable_grads = list(grads[len(inputs):])
            if keep_variable is not None:
                variable_grads = [g if keep_variable(v) else None
                                  for g, v in zip(variable_grads, variables)]
            return input_grads, variable_grads

        return results, gradient

    with tf.device(device):
        results = tf.custom_gradient(forward)(*distinct)
    outputs = structure["outputs"]
    flat_out = tf.nest.flatten(outputs)
    for i, placed in zip(structure["tensors_at"], results):
        models.keep_mask(flat_out[i], placed)  # Keras attaches masks to tensors; keep them.
        flat_out[i] = placed
    return tf.nest.pack_sequence_as(outputs, flat_out)

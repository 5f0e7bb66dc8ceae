"""Pipeline x ZeRO-3: each replica reads a stage's weights from their owners once per step.

Under `PipelineStrategy(num_replicas=R, shard="parameters")` a stage's trainable variable
lives on one owner among the stage's R devices. Read where a layer uses it, each of the M
micro-batches of every replica fetched it again from the owner: M x (R-1)/R of the stage's
weights per device and step (issue 36: ~49 GB per step at M=16 and 3.5 GB per stage). Here a
replica's stage takes one copy of each of its weights per step, on its own device, before its
first micro-batch; every micro-batch's forward (and a rematerialized rerun) reads that copy,
and the gradients are taken with respect to it, so they reach the owner as before, summed over
the micro-batches. The copies live for the step (FSDP with `reshard_after_forward=False`).
"""

import contextlib
import threading
import weakref

import tensorflow as tf

from tfpar.keras import hooks as keras_hooks
from tfpar.keras import internals
from tfpar.keras import models
from tfpar.keras import tf_variables

_local = threading.local()  # .copies: {id(tf.Variable): its copy} while a stage runs here.
# id -> weak reference of each tf.Variable whose reads may be served from a copy.
# (Variables are unhashable.)
_served = {}


def serve_from_copies(variable):
    """Makes reads of Keras `variable`'s storage return the copy `reading_copies` gives
    for it (in the thread that runs that stage), and its own value otherwise."""
    storage = models.tf_variable(variable)
    served = _served.get(id(storage))
    if served is not None and served() is storage:
        return
    base = type(storage)
    tf_variables.check_converts_through_dense_var_to_tensor(base)  # Fails closed first.

    @internals.overrides
    class ReadFromStepCopy(base):
        def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
            copies = getattr(_local, "copies", None)
            copy = None if copies is None or as_ref else copies.get(id(self))
            if copy is None or (dtype is not None and dtype != copy.dtype):
                return super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)
            return copy

    keras_hooks.patch_object(storage, "__class__", ReadFromStepCopy)
    _served[id(storage)] = weakref.ref(storage)


def take_copies(variables, device):
    """{id of each variable's storage: a copy of its value on `device`} (each variable read
    once, from wherever it lives)."""
    copies = {}
    with tf.device(device):  # (`read_value` ends in an identity here: the copy.)
        for variable in variables:
            storage = models.tf_variable(variable)
            copies[id(storage)] = storage.read_value()
    return copies


def copy_of(variable, copies):
    """The copy of `variable` in `copies`, or the variable itself."""
    return copies.get(id(models.tf_variable(variable)), variable)


@contextlib.contextmanager
def reading_copies(copies):
    """Reads of the served variables in `copies` return their copies meanwhile, in this
    thread (a pipeline replica runs its stages in its own thread)."""
    previous = getattr(_local, "copies", None)
    _local.copies = copies
    try:
        yield
    finally:
        _local.copies = previous

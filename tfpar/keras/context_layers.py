"""Keras and keras-hub layers under context parallelism: each replica holds a slice of the
sequence (`tfpar.distribute.context.sequence_split`), and the layers that look across
positions learn it, on the model's own layer instances, the first time the model runs
under the strategy (`prepare`):

- attention (Keras' `MultiHeadAttention` and keras-hub's subclass, Llama's and Gemma's) runs
  its local queries against the keys and values of the whole sequence, gathered from every
  replica in order; its mask covers the whole sequence (a padding mask gathered, the causal
  mask from each query's position in the sequence, an attention-mask input split by
  queries, its keys whole); Keras' and keras-hub's GPT-2 and Llama attention attend a block
  of keys at a time with a recomputing backward (`SequenceShards.attend`), the causal and
  padding masks made by blocks;
- keras-hub's transformer decoders (GPT-2's, Llama's, Gemma's blocks) build their
  self-attention mask that way, and learned and rotary position embeddings take the
  replica's positions in the sequence.

Every other layer acts on each position alone (a list read in each class's source,
Keras 3.10-3.15, keras-hub 0.2x-0.32); a model with any other layer, or a graph operation
that is not elementwise, is refused before its first step, naming it. Outside a replica of
a context-parallel strategy (an eager call, another strategy) each layer runs as it always
does.
"""

import functools
import inspect

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.keras import internals

# Layers that act on each position of a sequence alone (by class path, so that keras-hub
# need not be installed).
_POSITION_WISE = {
    f"keras.src.layers.{path}" for path in (
        "core.dense.Dense", "core.einsum_dense.EinsumDense", "core.embedding.Embedding",
        "core.identity.Identity", "core.input_layer.InputLayer", "core.lambda_layer.Lambda",
        "core.reversible_embedding.ReversibleEmbedding",
        "normalization.layer_normalization.LayerNormalization",
        "normalization.rms_normalization.RMSNormalization",
        "regularization.dropout.Dropout", "activations.activation.Activation",
        "activations.relu.ReLU", "activations.leaky_relu.LeakyReLU", "activations.elu.ELU",
        "merging.add.Add", "merging.multiply.Multiply", "merging.subtract.Subtract",
        "merging.average.Average", "merging.maximum.Maximum", "merging.minimum.Minimum")
} | {
    "keras_hub.src.layers.modeling.reversible_embedding.ReversibleEmbedding",
    "keras_hub.src.layers.modeling.token_and_position_embedding.TokenAndPositionEmbedding",
    "keras_hub.src.layers.modeling.transformer_encoder.TransformerEncoder",
    "keras_hub.src.models.llama.llama_layernorm.LlamaLayerNorm",
    "keras_hub.src.models.gemma.rms_normalization.RMSNormalization",
}
# (Lambda: a user's function; it is theirs to keep position-wise, as under any strategy
# that splits the batch it must keep example-wise.)

_ATTENTION = {  # Attention layers whose `_compute_attention(query, key, value, mask, ...)`
    # takes [batch, positions, heads, depth] keys and values.
    "keras.src.layers.attention.multi_head_attention.MultiHeadAttention",
    "keras_hub.src.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention",
    "keras_hub.src.models.llama.llama_attention.LlamaAttention",
    "keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention",
}
_DECODERS = {  # Blocks whose `_compute_self_attention_mask(sequence, padding, attention, ...)`
    # makes their causal self-attention mask.
    "keras_hub.src.layers.modeling.transformer_decoder.TransformerDecoder",
    "keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder",
}
_GEMMA_BLOCKS = {  # Blocks whose `_compute_attention_mask(x, padding_mask, cache,
    # cache_update_index)` makes their causal self-attention mask.
    "keras_hub.src.models.gemma.gemma_decoder_block.GemmaDecoderBlock",
}
_POSITIONS = {  # Layers whose `call(inputs, start_index=0, positions=None)` embeds positions.
    "keras_hub.src.layers.modeling.position_embedding.PositionEmbedding",
    "keras_hub.src.layers.modeling.rotary_embedding.RotaryEmbedding",
    "keras_hub.src.models.llama.llama_rotary_embedding.LlamaRotaryEmbedding",
}
_SOFTMAX = "keras.src.layers.activations.softmax.Softmax"  # (Inside attention: over keys.)
# Operations of a functional graph (keras.ops) that act elementwise.
_ELEMENTWISE_OPS = {"Add", "Subtract", "Multiply", "Divide", "TrueDivide", "Cast", "Negative",
                    "Maximum", "Minimum", "Tanh", "Sigmoid", "Relu", "Gelu", "Silu", "Exp",
                    "Sqrt", "Square", "Absolute", "Where", "Power", "NotEqual", "Equal"}


def _path(obj):
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _shards():
    """The replica's `SequenceShards` in a replica of a context-parallel strategy, else None."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return None
    return hooks_of(context.strategy)._tfpar_context_shards


def _local_length(x):
    length = x.shape[1]
    if length is None:
        raise ValueError(f"Context parallelism needs sequences of a static length; a layer "
                         f"received a tensor of shape {x.shape}.")
    return int(length)


def _whole_keys(mask, shards, local):
    """An attention mask `mask` ([batch or 1, queries or 1, keys]) over the whole
    sequence's keys: one over this replica's keys only gathered when it is a padding mask
    (one row); a mask over the whole sequence (an attention-mask input, split by queries)
    kept."""
    if mask is None or mask.shape[-1] == shards.length(local):
        return mask
    if mask.shape.rank == 3 and mask.shape[1] == 1:
        return shards.gather(mask, axis=2)
    raise ValueError(
        f"Under context parallelism an attention mask must cover the whole sequence's keys "
        f"({shards.length(local)}); a layer made one of shape {mask.shape} over this "
        f"replica's {local} keys. Pass the mask as a model input of shape (batch, sequence, "
        f"sequence), or as a padding mask.")


def _and(*masks):
    masks = [tf.cast(m, tf.bool) for m in masks if m is not None]
    if not masks:
        return None
    return functools.reduce(tf.logical_and, masks)


_LLAMA_ATTENTION = "keras_hub.src.models.llama.llama_attention.LlamaAttention"
_KERAS_ATTENTION = {
    "keras.src.layers.attention.multi_head_attention.MultiHeadAttention",
    "keras_hub.src.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention"}


def _blockwise(layer, query, args, kwargs):
    """(scale, masked_rows, returns_scores) when the layer's attention is softmax(scale q k^T)
    v that the strategy's blockwise attention (`SequenceShards.attend`) computes as the
    layer would, else None (the layer's own
    code runs, on the gathered keys). Keras' MultiHeadAttention without dropout on its
    probabilities goes through `ops.dot_product_attention` (a query that sees no key
    averages every value); Llama's through a `Softmax` layer (it outputs zeros)."""
    path = _path(layer)
    if path == _LLAMA_ATTENTION:
        return internals.attr(layer, "_inv_norm_factor"), "zero", False
    if path not in _KERAS_ATTENTION or query.shape.rank != 4:
        return None
    named = dict(zip(("training", "return_attention_scores"), args), **kwargs)
    if named.get("return_attention_scores") or internals.attr(layer, "_dropout") > 0:
        return None
    return internals.attr(layer, "_inverse_sqrt_key_dim"), "uniform", True


def _gathered_heads(layer, shards, x):
    """`x` ([batch, positions, heads, depth]) gathered over the sequence. Llama repeats each
    key/value head `num_key_value_groups` times before its attention (grouped-query
    attention): only the distinct heads travel, repeated after (the same values; the
    repeat's gradient sums the copies as Llama's own does)."""
    groups = getattr(layer, "num_key_value_groups", 1) if _path(layer) == _LLAMA_ATTENTION \
        else 1
    if groups == 1:
        return shards.gather(x)
    _check_repeats_heads(type(layer))
    return tf.repeat(shards.gather(x[:, :, ::groups]), groups, axis=2)


@functools.lru_cache(maxsize=None)
def _check_repeats_heads(cls):
    source = inspect.getsource(cls.call)
    internals.check(
        "ops.repeat(key, repeats=self.num_key_value_groups, axis=2)" in source
        and "ops.repeat(value, repeats=self.num_key_value_groups, axis=2)" in source,
        f"{cls.__name__}.call repeating each key/value head in place (ops.repeat, axis=2)")


def _attention(layer):
    compute = type(layer)._compute_attention

    def compute_attention(query, key, value, attention_mask=None, *args, **kwargs):
        shards = _shards()
        if shards is None:
            return compute(layer, query, key, value, attention_mask, *args, **kwargs)
        local = _local_length(key)
        causal = kwargs.pop("use_causal_mask", False)  # (Keras 3.15's causal-only path.)
        blockwise = _blockwise(layer, query, args, kwargs)
        keep = None
        if blockwise is not None and attention_mask is None and causal:
            keep = _made_by_blocks(shards, _local_length(query), None)
        elif blockwise is not None and attention_mask is not None:
            keep = _by_blocks.keep_of(attention_mask)
        mask = None if keep is not None else _and(
            _whole_keys(attention_mask, shards, local),
            shards.causal(_local_length(query)) if causal else None)
        key, value = (_gathered_heads(layer, shards, t) for t in (key, value))
        if blockwise is None:
            return compute(layer, query, key, value, mask, *args, **kwargs)
        scale, masked_rows, returns_scores = blockwise
        output = shards.attend(query, key, value, mask, scale, masked_rows, keep)
        output = tf.cast(output, layer.compute_dtype)
        return (output, None) if returns_scores else output

    return compute_attention


def _attention_mask(layer):
    make = type(layer)._compute_attention_mask

    def compute_attention_mask(query, value, query_mask=None, value_mask=None, key_mask=None,
                               attention_mask=None, use_causal_mask=False):
        shards = _shards()
        if shards is None:
            return make(layer, query, value, query_mask, value_mask, key_mask, attention_mask,
                        use_causal_mask)
        local = _local_length(value)
        gather = lambda m: None if m is None else shards.gather(m)  # noqa: E731
        value_mask_whole = gather(value_mask)
        key_mask_whole = value_mask_whole if key_mask is value_mask else gather(key_mask)
        mask = make(layer, query, value, query_mask, value_mask_whole, key_mask_whole,
                    _whole_keys(attention_mask, shards, local), False)
        return _and(mask, shards.causal(_local_length(query)) if use_causal_mask else None)

    return compute_attention_mask


def _decoder_mask(layer):
    make = type(layer)._compute_self_attention_mask
    signature = inspect.signature(make)

    def compute_self_attention_mask(*args, **kwargs):
        shards = _shards()
        if shards is None:
            return make(layer, *args, **kwargs)
        given = signature.bind(layer, *args, **kwargs).arguments
        if any(given.get(name) is not None for name in (
                "self_attention_cache", "self_attention_cache_update_index")):
            raise ValueError("Context parallelism trains without a cache (cached decoding "
                             "is generation, not training).")
        if given.get("use_causal_mask", True) is False:
            raise ValueError("Context parallelism runs keras-hub decoders with their causal "
                             "mask (use_causal_mask=False is not supported).")
        return _causal_mask(shards, given["decoder_sequence"], given["decoder_padding_mask"],
                            given["decoder_attention_mask"])

    return compute_self_attention_mask


def _causal_mask(shards, sequence, padding, attention_mask=None):
    """A decoder's self-attention mask over the whole sequence, [batch, local, length]
    (int32, as keras-hub's): the padding (`padding`, else the sequence's Keras mask)
    gathered, an attention mask over the whole sequence's keys, causality by position."""
    local = _local_length(sequence)
    if padding is None:
        padding = internals.symbol("keras.src.backend.common.masking.get_keras_mask")(sequence)
    padding = None if padding is None else shards.gather(padding)[:, None, :]
    mask = _and(padding, _whole_keys(attention_mask, shards, local), shards.causal(local))
    batch = tf.shape(sequence)[0]
    whole = tf.cast(tf.broadcast_to(mask, [batch, local, shards.length(local)]), tf.int32)
    if attention_mask is None:
        # The attention this mask reaches makes it by blocks (and then nothing reads the
        # whole, which the traced step never computes).
        _by_blocks.remember(whole, _made_by_blocks(shards, local, padding))
    return whole


def _made_by_blocks(shards, local, padding):
    """`keep(start, end)` for blockwise attention: a causal mask (and a padding mask, [batch,
    1, length]) over keys start:end, made when a block needs it."""
    positions = shards.positions(local)

    def keep(start, end):
        visible = positions[None, :, None] >= tf.range(start, end)[None, None, :]
        return visible if padding is None else tf.logical_and(
            visible, tf.cast(padding[..., start:end], tf.bool))

    return keep


class _MasksByBlocks:
    """Masks made whole by a decoder (as keras-hub's attention layers take them) that the
    attention under context parallelism makes by blocks instead: {id: (tensor, keep)}, the
    tensor kept to tell a reused id apart, forgotten when its trace ends."""

    def __init__(self):
        self._known = {}

    def remember(self, mask, keep):
        self._known[id(mask)] = (mask, keep)
        if len(self._known) > 64:  # (Older traces' masks: never asked for again.)
            self._known.pop(next(iter(self._known)))

    def keep_of(self, mask):
        known = self._known.get(id(mask))
        return known[1] if known is not None and known[0] is mask else None


_by_blocks = _MasksByBlocks()


def _block_mask(layer):
    make = type(layer)._compute_attention_mask

    def compute_attention_mask(x, padding_mask, cache, cache_update_index):
        shards = _shards()
        if shards is None:
            return make(layer, x, padding_mask, cache, cache_update_index)
        if cache is not None:
            raise ValueError("Context parallelism trains without a cache (cached decoding "
                             "is generation, not training).")
        return _causal_mask(shards, x, padding_mask)

    return compute_attention_mask


def _positioned(layer):
    call = type(layer).call

    def positioned_call(inputs, start_index=0, positions=None):
        shards = _shards()
        if shards is None or positions is not None:
            return call(layer, inputs, start_index=start_index, positions=positions)
        if not (isinstance(start_index, int) and start_index == 0):
            raise ValueError("Context parallelism trains without a cache: positions start "
                             "at 0.")
        return call(layer, inputs, positions=shards.positions(_local_length(inputs)))

    return positioned_call


def _refusal(model):
    """Why `model` cannot run with its sequence split, naming the layer or operation, or
    None."""
    import keras

    layers = list(internals.attr(model, "_flatten_layers")(include_self=False))
    # (An attention layer's softmax runs over the keys, which it gathers whole.)
    inside = {id(sub) for layer in layers if _path(layer) in _ATTENTION
              for sub in internals.attr(layer, "_flatten_layers")(include_self=False)}
    for layer in layers:
        path = _path(layer)
        if isinstance(layer, keras.Model):
            continue  # (A model's layers are in the walk; its operations below.)
        if id(layer) in inside and path == _SOFTMAX:
            continue
        if path in _POSITION_WISE | _ATTENTION | _DECODERS | _GEMMA_BLOCKS | _POSITIONS:
            if isinstance(layer, keras.layers.MultiHeadAttention) \
                    and internals.attr(layer, "_sliding_window") is not None \
                    or getattr(layer, "use_sliding_window_attention", False):
                return f"attention layer {layer.name!r} has a sliding window"
            continue
        return (f"layer {layer.name!r} ({type(layer).__name__}) is not known to act on each "
                f"position alone")
    if not any(_path(layer) in _ATTENTION for layer in layers):
        return ("the model has no attention layer (the sequence is the second axis of its "
                "inputs, which only attention looks across)")
    for nested in [model] + [m for m in internals.attr(model, "_flatten_layers")()
                             if isinstance(m, keras.Model)]:
        for operation in getattr(nested, "operations", []):
            if isinstance(operation, keras.layers.Layer):
                continue
            if type(operation).__name__ not in _ELEMENTWISE_OPS:
                return (f"operation {operation.name!r} ({type(operation).__name__}) of model "
                        f"{nested.name!r} is not elementwise")
    return None


def _any_length(model):
    """Lets a functional model (and each nested one) take its inputs' sequences at a
    replica's length: their input specs' second axis (a static sequence length) made free,
    through Keras' public `input_spec` setter."""
    import keras

    for nested in [model] + [m for m in internals.attr(model, "_flatten_layers")()
                             if isinstance(m, keras.Model)]:
        specs = getattr(nested, "input_spec", None)
        if not isinstance(specs, list) or not any(
                spec.shape is not None and len(spec.shape) >= 2 and spec.shape[1] is not None
                for spec in specs):
            continue
        nested.input_spec = [
            keras.InputSpec(dtype=spec.dtype, shape=(spec.shape[0], None, *spec.shape[2:]),
                            allow_last_axis_squeeze=spec.allow_last_axis_squeeze,
                            name=spec.name, optional=spec.optional)
            if spec.shape is not None and len(spec.shape) >= 2 else spec for spec in specs]


def prepare(model):
    """What teaches `model`'s attention, decoder and position layers the split sequence:
    [(layer, attribute, function)] to set on its own instances (`hooks.patch_object`;
    outside a context-parallel replica they run as before). Raises ValueError naming a
    layer that cannot run on a slice of the sequence."""
    refusal = _refusal(model)
    if refusal is not None:
        raise ValueError(
            f"Context parallelism splits every sequence over the replicas, so each layer must "
            f"act on each position alone, or be an attention, decoder or position layer tfpar "
            f"knows: {refusal}. Train this model with data parallelism (context_parallel=1), "
            f"or build it of Keras and keras-hub transformer layers.")
    _any_length(model)
    patches = []
    for layer in internals.attr(model, "_flatten_layers")(include_self=False):
        path = _path(layer)
        if path in _ATTENTION:
            patches.append((layer, "_compute_attention", _attention(layer)))
            if hasattr(type(layer), "_compute_attention_mask"):
                patches.append((layer, "_compute_attention_mask", _attention_mask(layer)))
        elif path in _DECODERS:
            patches.append((layer, "_compute_self_attention_mask", _decoder_mask(layer)))
        elif path in _GEMMA_BLOCKS:
            patches.append((layer, "_compute_attention_mask", _block_mask(layer)))
        elif path in _POSITIONS:
            internals.check("positions" in inspect.signature(type(layer).call).parameters,
                            f"{type(layer).__name__}.call(inputs, start_index, positions)")
            patches.append((layer, "call", _positioned(layer)))
    return patches


def _whole_sequences_predicted(predict_step):
    """TensorFlowTrainer.predict_step: under context parallelism each replica predicts its
    positions; the sequences are gathered whole and handed over by the first replica
    alone (the others hand none), so that Keras' concatenation of the replicas' outputs is
    each example's prediction, in order."""

    @functools.wraps(predict_step)
    def wrapper(self, data):
        predicted = predict_step(self, data)
        shards = _shards()
        if shards is None:
            return predicted
        first = shards.is_first()

        def whole(t):
            if not isinstance(t, tf.Tensor) or t.shape.rank is None or t.shape.rank < 2:
                return t
            gathered = shards.gather(t)
            return gathered if first else gathered[:0]

        return tf.nest.map_structure(whole, predicted)

    return wrapper


def patches():
    """What tfpar replaces in Keras for context parallelism: (owner, attribute, wrap)."""
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    return [(trainer, "predict_step", _whole_sequences_predicted)]

"""keras-hub backbones (GPT-2, Llama, Gemma, BERT, small configs, nothing downloaded) with a
Dense head under each kind of tfpar strategy, trained with plain `fit`, against one device
(issue 37): equal at 1e-5, or refused before any step with a clear error. The README's
"keras-hub backbones" table is rendered from `EXPECTED` and checked here, so it says what
the suite measured.

The batch is padded (a third of the rows end in padding), so the padding mask is read in
every block; a pipeline of 4 stages cuts between the blocks inside the backbone, its stages
passing the hidden states and the padding mask (and BERT's segment ids)."""

import os

import keras
import numpy as np
import pytest

import tfpar
from harness import cpus

keras_hub = pytest.importorskip("keras_hub")

VOCABULARY, LENGTH, EXAMPLES, BATCH, EPOCHS, ATOL = 32, 8, 32, 16, 2, 1e-5
README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _backbone(name):
    models = keras_hub.models
    if name == "GPT-2":
        return models.GPT2Backbone(vocabulary_size=VOCABULARY, num_layers=3, num_heads=2,
                                   hidden_dim=16, intermediate_dim=32,
                                   max_sequence_length=LENGTH, dropout=0.0)
    if name == "Llama":
        return models.LlamaBackbone(vocabulary_size=VOCABULARY, num_layers=3,
                                    num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
                                    intermediate_dim=32)
    if name == "Gemma":
        return models.GemmaBackbone(vocabulary_size=VOCABULARY, num_layers=3,
                                    num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
                                    intermediate_dim=32, head_dim=4)
    assert name == "BERT"
    return models.BertBackbone(vocabulary_size=VOCABULARY, num_layers=3, num_heads=2,
                               hidden_dim=16, intermediate_dim=32,
                               max_sequence_length=LENGTH, dropout=0.0)


def _model(name):
    keras.utils.set_random_seed(0)
    backbone = _backbone(name)
    inputs = {key: keras.Input((LENGTH,), dtype="int32", name=key) for key in backbone.input}
    hidden = backbone(inputs)
    if isinstance(hidden, dict):
        hidden = hidden["sequence_output"]
    model = keras.Model(inputs, keras.layers.Dense(VOCABULARY, name="lm_head")(hidden))
    # epsilon 1e-3: gradients that are 0 in exact arithmetic (a key bias) carry rounding
    # noise that depends on the order of sums, and Adam's 1e-7 would scale it to a step.
    model.compile(keras.optimizers.Adam(0.01, epsilon=1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(model):
    rng = np.random.default_rng(0)
    padding = np.ones((EXAMPLES, LENGTH), "int32")
    padding[::3, LENGTH - 3:] = 0
    x = {"token_ids": rng.integers(1, VOCABULARY, (EXAMPLES, LENGTH)).astype("int32") * padding,
         "padding_mask": padding}
    if "segment_ids" in model.input:
        x["segment_ids"] = np.repeat((np.arange(LENGTH)[None] >= LENGTH // 2).astype("int32"),
                                     EXAMPLES, 0)
    return x, rng.integers(0, VOCABULARY, (EXAMPLES, LENGTH)).astype("int32")


def _megatron_layout(mesh=None):
    """Megatron's split of each block over the 'model' axis, by keras-hub's paths: attention
    by heads, the MLP's first layer(s) by columns and its last by rows."""
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*(query|key|value)/kernel"] = (None, "model", None)
    layout_map[r".*attention_output/kernel"] = ("model", None, None)
    layout_map[r".*(feedforward_intermediate_dense|feedforward_gate_dense|ffw_gating|"
               r"ffw_gating_2|intermediate_dense)/kernel"] = (None, "model")
    layout_map[r".*(feedforward_output_dense|ffw_linear|output_dense)/kernel"] = ("model", None)
    return layout_map


def _mesh(name):
    """A 2 x 2 mesh with the backbone's own `get_layout_map` where keras-hub has one."""
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:4])
    backbone = type(_backbone(name))
    own = "get_layout_map" in vars(backbone)
    return tfpar.MeshStrategy(mesh, backbone.get_layout_map(mesh) if own else
                              _megatron_layout(mesh))


STRATEGIES = {  # column: (how it is made, what the README calls it)
    "dp2": (lambda name: tfpar.DataParallelStrategy(cpus(2)), "data parallel, 2"),
    "zero1": (lambda name: tfpar.DataParallelStrategy(cpus(2), shard="optimizer"),
              "ZeRO-1, 2"),
    "zero2": (lambda name: tfpar.DataParallelStrategy(cpus(2), shard="gradients"),
              "ZeRO-2, 2"),
    "zero3": (lambda name: tfpar.DataParallelStrategy(cpus(2), shard="parameters"),
              "ZeRO-3, 2"),
    "pipe4": (lambda name: tfpar.PipelineStrategy(cpus(4), num_micro_batches=2),
              "pipeline, 4 stages (cut between blocks)"),
    "pipe_tp": (lambda name: tfpar.PipelineStrategy(
        cpus(4), num_stages=2, num_micro_batches=2, tensor_parallel=2,
        layout_map=_megatron_layout()), "pipeline 2 x tensor 2 (Megatron split)"),
    "mesh": (_mesh, "MeshStrategy 2 x 2, the backbone's own layout map (else Megatron's)"),
    "cp2": (lambda name: tfpar.DataParallelStrategy(cpus(2), context_parallel=2),
            "context parallel, 2 (the sequence split)"),
}
BACKBONES = ("GPT-2", "Llama", "Gemma", "BERT")
# "equal", or "refused: <what the error says>"
EXPECTED = {(b, s): "equal" for b in BACKBONES for s in STRATEGIES}
EXPECTED[("Llama", "mesh")] = "refused: DTensor cannot run"
EXPECTED[("BERT", "cp2")] = "refused: of model 'bert_backbone' is not elementwise"


@pytest.fixture(scope="module")
def one_device():
    cache = {}

    def trained(name):
        if name not in cache:
            model = _model(name)
            initial = model.get_weights()
            model.fit(*_data(model), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
            cache[name] = (initial, model.get_weights())
        return cache[name]

    return trained


@pytest.mark.parametrize("sid", sorted(STRATEGIES))
@pytest.mark.parametrize("name", BACKBONES)
def test_backbone_trains_as_one_device_or_is_refused(name, sid, one_device):
    strategy = STRATEGIES[sid][0](name)
    with strategy.scope():
        model = _model(name)
    x, y = _data(model)
    expected = EXPECTED[(name, sid)]
    if expected.startswith("refused: "):
        initial = model.get_weights()
        with pytest.raises(ValueError, match=expected.split(": ", 1)[1]):
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 0
        assert all(np.array_equal(a, b) for a, b in zip(initial, model.get_weights()))
        return
    if sid == "pipe4":  # Cut inside the backbone: its 3 blocks on 3 stages.
        stages = strategy.stages(model)
        blocks = [i for i, stage in enumerate(stages) for layer in stage
                  if layer.startswith(("transformer_layer_", "decoder_block_"))]
        assert len(stages) == 4 and len(set(blocks)) == 3, stages
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    initial, want = one_device(name)
    assert max(np.abs(w - w0).max() for w, w0 in zip(want, initial)) > 1e-3
    for got, expected_weight, variable in zip(model.get_weights(), want, model.weights):
        np.testing.assert_allclose(got, expected_weight, atol=ATOL, err_msg=variable.path)


def readme_table():
    """The README's table, rendered from EXPECTED."""
    names = [STRATEGIES[s][1] for s in STRATEGIES]
    rows = ["| backbone | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names)]
    for b in BACKBONES:
        cells = ["equal" if EXPECTED[(b, s)] == "equal" else
                 f"refused ({EXPECTED[(b, s)].split(': ', 1)[1]} ...)" for s in STRATEGIES]
        rows.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def test_the_readme_table_is_what_the_suite_measures():
    with open(README) as f:
        text = f.read()
    assert readme_table() in text, "README's keras-hub table differs; paste:\n" + readme_table()

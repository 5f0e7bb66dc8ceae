"""Pipeline-parallel training of a Keras model with tfpar: a short binary to copy.

The model is cut into stages at the `StageBoundary` markers, one stage per device;
each batch flows through them in micro-batches.

    python examples/pipeline.py --num_devices=2 --num_micro_batches=8 --schedule=1f1b
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

import tfpar  # noqa: E402  (cheap: TensorFlow is imported on first use)

flags.DEFINE_integer("num_devices", 2, "Stages x replicas; logical CPUs when there is no GPU.")
flags.DEFINE_integer("num_replicas", 1, "Pipeline replicas (each gets num_devices / replicas).")
flags.DEFINE_integer("num_micro_batches", 8, "Micro-batches per batch.")
flags.DEFINE_enum("schedule", "gpipe", ("gpipe", "1f1b"), "Pipeline schedule.")
flags.DEFINE_bool("remat", False, "Recompute activations in the backward pass.")
flags.DEFINE_integer("epochs", 10, "Epochs.")
flags.DEFINE_integer("batch_size", 128, "Global batch: a multiple of replicas x micro-batches.")
FLAGS = flags.FLAGS


def main(_):
    logging.set_verbosity(logging.WARNING)  # TensorFlow's per-reduction INFO lines
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        tfpar.virtual_cpus(FLAGS.num_devices)  # before TensorFlow creates any tensor
    import keras

    strategy = tfpar.PipelineStrategy(
        num_micro_batches=FLAGS.num_micro_batches, schedule=FLAGS.schedule, remat=FLAGS.remat,
        num_replicas=FLAGS.num_replicas)
    train = tfpar.data.load("spirals", "train")
    dataset = (train.dataset.shuffle(train.num_examples, seed=0)
               .batch(FLAGS.batch_size, drop_remainder=True))  # equal micro-batches

    layers = [keras.layers.Dense(128, activation="relu") for _ in range(4)]
    # One marker between consecutive stages; without markers tfpar balances the cut.
    per_stage = len(layers) // strategy.num_stages
    body = []
    for i, layer in enumerate(layers):
        if i and i % per_stage == 0 and i // per_stage < strategy.num_stages:
            body.append(tfpar.layers.StageBoundary())
        body.append(layer)
    with strategy.scope():  # plain Keras from here on
        model = keras.Sequential([keras.Input(train.input_shape), *body,
                                  keras.layers.Dense(train.num_classes)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(dataset, epochs=FLAGS.epochs, verbose=2)
    print(strategy.schedule_table())
    print("stages:", strategy.stages(model))
    test = tfpar.data.load("spirals", "test").dataset.batch(FLAGS.batch_size)
    loss, accuracy = model.evaluate(test, verbose=0)
    print(f"{strategy}: test loss={loss:.4f} accuracy={accuracy:.4f}")


if __name__ == "__main__":
    app.run(main)

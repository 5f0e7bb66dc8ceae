"""Parameter-server training of a Keras model with tfpar: a short binary to copy.

Run it as the chief of a cluster; the launcher starts the workers and ps tasks:

    tfpar launch --workers 2 --ps 2 -- python examples/parameter_server.py --mode=async
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import tfpar  # noqa: E402  (cheap: TensorFlow is imported on first use)

flags.DEFINE_enum("mode", "async", ["async", "sync"], "Asynchronous or averaged updates.")
flags.DEFINE_integer("epochs", 5, "Epochs.")
flags.DEFINE_integer("steps_per_epoch", 100, "Steps per epoch, over all workers.")
flags.DEFINE_integer("batch_size", 64, "Batch size of one step.")
FLAGS = flags.FLAGS


def main(_):
    import keras
    import tensorflow as tf

    # Variables of 64 KiB or more are split over the ps tasks.
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=64 << 10, max_shards=2)
    strategy = tfpar.ParameterServerStrategy(variable_partitioner=partitioner, mode=FLAGS.mode)
    train = tfpar.data.load("spirals", "train")

    def dataset_fn(input_context):  # traced and built on every worker
        return (tfpar.data.load("spirals", "train").dataset.shuffle(10000)
                .batch(FLAGS.batch_size).repeat())

    with strategy.scope():  # plain Keras from here on
        model = keras.Sequential([
            keras.Input(train.input_shape),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(train.num_classes),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    data = train.dataset.batch(FLAGS.batch_size) if FLAGS.mode == "sync" else dataset_fn
    model.fit(data, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, verbose=2)
    test = tfpar.data.load("spirals", "test").dataset.batch(256)
    loss, accuracy = model.evaluate(test, verbose=0)
    print(f"{strategy}: steps={int(model.optimizer.iterations.numpy())} "
          f"test loss={loss:.4f} accuracy={accuracy:.4f}")


if __name__ == "__main__":
    app.run(main)

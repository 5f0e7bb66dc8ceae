"""Data-parallel training of a Keras model with tfpar: a short binary to copy.

    python examples/data_parallel.py --num_devices=2 --epochs=10 --batch_size=128
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import tfpar  # noqa: E402  (cheap: TensorFlow is imported on first use)

flags.DEFINE_integer("num_devices", 2, "Replicas; logical CPUs when there is no GPU.")
flags.DEFINE_integer("epochs", 10, "Epochs.")
flags.DEFINE_integer("batch_size", 128, "Global batch size, split over the replicas.")
FLAGS = flags.FLAGS


def main(_):
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        tfpar.virtual_cpus(FLAGS.num_devices)  # before TensorFlow creates any tensor
    import keras

    strategy = tfpar.DataParallelStrategy()
    train = tfpar.data.load("spirals", "train")
    dataset = train.dataset.shuffle(train.num_examples, seed=0).batch(FLAGS.batch_size)

    with strategy.scope():  # plain Keras from here on
        model = keras.Sequential([
            keras.Input(train.input_shape),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(train.num_classes),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(dataset, epochs=FLAGS.epochs, verbose=2)
    test = tfpar.data.load("spirals", "test").dataset.batch(FLAGS.batch_size)
    loss, accuracy = model.evaluate(test, verbose=0)
    print(f"{strategy}: test loss={loss:.4f} accuracy={accuracy:.4f}")


if __name__ == "__main__":
    app.run(main)

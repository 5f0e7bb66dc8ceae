"""What the benchmarks share: arguments, the MLP and its SGD replica step."""

import os


def add_common_args(parser, width, layers, steps, rounds, out_name):
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      out_name))


def mlp_and_step(args, global_batch):
    """An MLP (layers x width, 10-way head) with SGD, and its replica step for strategy.run.

    Call under the strategy's scope.
    """
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((args.width,))]
        + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
        + [keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.001)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return model, replica_step


def batch(global_batch, width, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.normal(size=(global_batch, width)).astype("float32"),
            rng.integers(0, 10, global_batch).astype("int32"))

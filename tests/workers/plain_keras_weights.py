"""Loads pairs of checkpoints (`.weights.h5` or `.keras`) of the memory test's MLP in plain
Keras (no tfpar in this process) and prints the largest difference between the weights of
each pair, as JSON (one process for all: each start costs seconds).

    python plain_keras_weights.py WIDTH LAYERS A.weights.h5 B.keras [C.weights.h5 D.keras ...]
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402


def weights(width, layers, path):
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width, activation="tanh")
                                for _ in range(layers)] + [keras.layers.Dense(10)])
    model.load_weights(path)
    return [w.numpy() for w in model.weights]


if __name__ == "__main__":
    width, layers, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    differences, count = [], None
    for first, second in zip(paths[::2], paths[1::2]):
        a = weights(width, layers, first)
        b = weights(width, layers, second)
        count = len(a)
        differences.append(max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)))
    print(json.dumps({"variables": count, "max_differences": differences,
                      "tfpar_imported": "tfpar" in sys.modules}))

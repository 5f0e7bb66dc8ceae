"""Loads pairs of checkpoints (`.weights.h5` or `.keras`) of the memory test's MLP in plain
Keras (no tfpar in this process) and prints the largest difference between the weights of
each pair, as JSON (one process for all: each start costs seconds). A `.keras` file is read
as users read one, `keras.models.load_model` with its optimizer (`load_weights` of a
`.keras` reads the h5 inside the zip on the fly: 24 s for this model's 800 MB, against 4).

    python plain_keras_weights.py WIDTH LAYERS A.weights.h5 B.keras [C.weights.h5 D.keras ...]
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402


def main(width, layers, paths):
    # One model (building 100M parameters costs seconds), and each file read once.
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width, activation="tanh")
                                for _ in range(layers)] + [keras.layers.Dense(10)])
    cache = {}

    def weights(path):
        if path in cache:
            cache[path] = cache.pop(path)  # The most recently used is evicted last.
        else:
            if len(cache) == 2:  # At most three copies of the weights alive at once.
                cache.pop(next(iter(cache)))
            if path.endswith(".keras"):
                loaded = keras.models.load_model(path)
                assert loaded.optimizer.built, f"{path}: no optimizer state"
                cache[path] = [w.numpy() for w in loaded.weights]
            else:
                model.load_weights(path)
                cache[path] = [w.numpy() for w in model.weights]
        return cache[path]

    differences = []
    for first, second in zip(paths[::2], paths[1::2]):
        a, b = weights(first), weights(second)
        differences.append(max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)))
    return {"variables": len(model.weights), "max_differences": differences,
            "tfpar_imported": "tfpar" in sys.modules}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])))

"""Serve a tf.data service dispatcher or worker until killed.

`tfpar launch --data_service` starts one dispatcher and one tf.data service worker per
training worker with this module, and gives every task the dispatcher's address in the
environment variable `TFPAR_DATA_SERVICE` (`DATA_SERVICE_ENV`):

    python -m tfpar.cluster.data_service --role=dispatcher --port=5050
    python -m tfpar.cluster.data_service --role=worker --port=5051 --dispatcher=127.0.0.1:5050

A training program reads it with, e.g.:

    address = os.environ[tfpar.cluster.data_service.DATA_SERVICE_ENV]   # "grpc://127.0.0.1:5050"
    dataset = dataset.apply(tf.data.experimental.service.distribute("distributed_epoch", address))

Importing this module does not import TensorFlow (the launcher imports it for the name).
"""

DATA_SERVICE_ENV = "TFPAR_DATA_SERVICE"
ROLES = ("dispatcher", "worker")
PROTOCOL = "grpc"


def serve_dispatcher(port):
    """Starts a tf.data service dispatcher on `port` and blocks until the process is killed."""
    import tensorflow as tf

    server = tf.data.experimental.service.DispatchServer(
        tf.data.experimental.service.DispatcherConfig(port=port, protocol=PROTOCOL))
    print(f"tfpar.cluster.data_service: dispatcher serving at {server.target}", flush=True)
    server.join()


def serve_worker(port, dispatcher, host="127.0.0.1"):
    """Starts a tf.data service worker on `port`, registered with the dispatcher at
    `dispatcher` ("host:port", with or without "grpc://"), and blocks until killed."""
    import tensorflow as tf

    dispatcher = dispatcher.split("://", 1)[-1]
    server = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(
            dispatcher_address=dispatcher, worker_address=f"{host}:{port}", port=port,
            protocol=PROTOCOL))
    print(f"tfpar.cluster.data_service: worker serving at {PROTOCOL}://{host}:{port} for the "
          f"dispatcher at {dispatcher}", flush=True)
    server.join()


def _define_flags():
    # Defined only when run as a program: the launcher imports this module for
    # DATA_SERVICE_ENV, and its own flags (e.g. --host) must not clash with these.
    from absl import flags

    flags.DEFINE_enum("role", None, ROLES, "What to serve: the dispatcher or a worker.")
    flags.DEFINE_integer("port", None, "Port to serve on.")
    flags.DEFINE_string("dispatcher", None, "For --role=worker: the dispatcher's host:port.")
    flags.DEFINE_string("host", "127.0.0.1", "For --role=worker: the address it is reached at.")
    flags.mark_flags_as_required(["role", "port"])


def main(argv):
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    FLAGS = flags.FLAGS
    if FLAGS.role == "dispatcher":
        serve_dispatcher(FLAGS.port)
    elif not FLAGS.dispatcher:
        raise app.UsageError("--role=worker needs --dispatcher=HOST:PORT.")
    else:
        serve_worker(FLAGS.port, FLAGS.dispatcher, FLAGS.host)


def entry():
    from absl import app

    _define_flags()
    app.run(main)


if __name__ == "__main__":
    entry()

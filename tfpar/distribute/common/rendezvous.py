"""Workers that must meet check that they will, and say who did not.

Two checks over TensorFlow's coordination service (its key-value store, which
multi-worker strategies start on the first worker):

- `check_same_strategies`: when a worker makes its n-th cross-worker strategy, it
  publishes what it made and where, and compares with every other worker's n-th.
  Workers that made different strategies, or a different number, would wait
  forever at their first collective; this fails at once with the difference.
- `explain_timeout`: when a collective times out, the worker says so in the store
  and waits briefly for the others to say the same. Those that do not are the ones
  that did not arrive: not listening (dead) or listening but not in the collective
  (stuck, or running other code). The error names them.
"""

import json
import os
import time
import traceback

import tensorflow as tf

from tfpar.cluster.probe import listening
from tfpar.errors import ClusterError
from tfpar.keras import tf_runtime

_PREFIX = "tfpar"
# After a timeout, how long the other waiting workers get to report theirs.
TIMEOUT_REPORT_SECONDS = 10.0


def _store():
    return tf_runtime.coordination_service()


def _get(key, timeout_seconds):
    """The value of `key`, waiting up to `timeout_seconds`; None when it never came."""
    try:
        return _store().get_config_key_value(
            key, timeout_in_ms=max(1, int(timeout_seconds * 1000)))
    except (tf.errors.DeadlineExceededError, tf.errors.NotFoundError,
            tf.errors.UnavailableError):
        return None


def exchange(peers, key, value, timeout_seconds, missing):
    """Publishes this task's `value` under `key`; yields (peer, its value) for each peer.

    Raises:
      ClusterError: `missing(peer)` when a peer published nothing within the timeout.
    """
    _store().set_config_key_value(f"{_PREFIX}/{key}/{peers.me}", value)
    for peer in peers.peers:
        theirs = _get(f"{_PREFIX}/{key}/{peer}", timeout_seconds)
        if theirs is None:
            raise ClusterError(missing(peer))
        yield peer, theirs


def creation_site():
    """"file:line" of the user's code that made the strategy (outside tfpar)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(package + os.sep):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


def check_same_strategies(peers, index, description, timeout_seconds):
    """Checks that every peer made the same `index`-th cross-worker strategy.

    Args:
      peers: this task and the other training tasks (`multi_worker.Peers`).
      index: 0 for the first cross-worker strategy of each process, 1 next, ...
      description: what the strategy is (its repr and options).
      timeout_seconds: how long a peer gets to make its strategy.

    Raises:
      ClusterError: naming the worker that made another strategy, or none in time.
    """
    site, me = creation_site(), peers.me
    mine = json.dumps({"strategy": description, "at": site})

    def missing(peer):
        return (f"{me} made cross-worker strategy #{index + 1} ({description}, at {site}), "
                f"but {peer} made no strategy #{index + 1} within {timeout_seconds:g}s. Every "
                f"worker must make the same tfpar strategies in the same order: their "
                f"collectives are matched by order, and a worker that made fewer would "
                f"wait forever.")
    for peer, theirs in exchange(peers, f"strategy/{index}", mine, timeout_seconds, missing):
        theirs = json.loads(theirs)
        if theirs["strategy"] != description:
            raise ClusterError(
                f"Workers made different cross-worker strategies #{index + 1}: {me} made "
                f"{description} (at {site}), {peer} made {theirs['strategy']} (at "
                f"{theirs['at']}). Every worker must make the same tfpar strategies in the "
                f"same order.")


def longest(peers, key, length, timeout_seconds):
    """The longest of every worker's `length` (a dataset cardinality): unknown (-2) if
    any is unknown, else infinite (-1) if any is infinite, else the maximum."""
    def missing(peer):
        return (f"{peer} made no dataset {key!r} within {timeout_seconds:g}s: every worker "
                f"must call distribute_datasets_from_function as often as the others.")
    lengths = [int(length)] + [
        int(theirs) for _, theirs in exchange(peers, key, str(int(length)), timeout_seconds,
                                               missing)]
    for special in (tf.data.UNKNOWN_CARDINALITY, tf.data.INFINITE_CARDINALITY):
        if special in lengths:
            return special
    return max(lengths)


def check_backup_everywhere(peers, key, path, timeout_seconds):
    """Raises ClusterError unless every worker sees the backup at `path`, or none does
    (sharded state: each worker restores its own share from the chief's files)."""
    def missing(peer):
        return f"{peer} did not say within {timeout_seconds:g}s whether it has a backup."
    mine = "1" if os.path.exists(path) else "0"
    seen = {peers.me: mine, **dict(exchange(peers, key, mine, timeout_seconds, missing))}
    if len(set(seen.values())) > 1:
        without = sorted(name for name, has in seen.items() if has == "0")
        raise ClusterError(
            f"DataParallelStrategy(shard=...) across workers resumes from the chief's backup, "
            f"which every worker must read (each restores the state it owns), but "
            f"{', '.join(without)} cannot see {path}. Put BackupAndRestore's backup_dir on a "
            f"filesystem all workers share.")


def explain_timeout(error, peers, timeout_seconds, report_seconds=TIMEOUT_REPORT_SECONDS):
    """A ClusterError for collective timeout `error` that names who did not arrive.

    Args:
      peers: this task and the others (`multi_worker.Peers`); their addresses tell dead
        tasks from stuck ones.
    """
    me, addresses = peers.me, peers.addresses
    try:
        _store().set_config_key_value(f"{_PREFIX}/timed_out/{me}", "1")
        store = True
    except tf.errors.OpError:
        store = False  # The store's task is gone: probes alone tell.
    # The others waiting at the same collective time out at about the same time.
    deadline = time.monotonic() + min(report_seconds, timeout_seconds)
    waited, missing = [], []
    for peer in peers.peers:
        reported = store and _get(f"{_PREFIX}/timed_out/{peer}",
                                  max(0.001, deadline - time.monotonic())) is not None
        (waited if reported else missing).append(peer)
    described = []
    for peer in missing:
        if listening(addresses[peer]):
            described.append(f"{peer} (alive, but not in the collective: stuck, or running "
                             f"other steps than the others)")
        else:
            described.append(f"{peer} (not reachable at {addresses[peer]}: it died)")
    if not described:
        who = "every worker reported waiting too (a step that cannot finish in time?)"
    else:
        who = f"{', '.join(described)} did not arrive"
    also = f"; {', '.join(waited)} waited too" if waited else ""
    return ClusterError(
        f"A collective timed out after {timeout_seconds:g}s on {me}: {who}{also}. A worker "
        f"that stops calling collectives (an exception caught in your code, a different "
        f"number of steps, a deadlock) makes the others wait; a slow first step may need a "
        f"larger DataParallelStrategy(timeout_seconds=...). TensorFlow said: "
        f"{_summary(error)}")


def _summary(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "timed out" in line), lines[-1] if lines else "")

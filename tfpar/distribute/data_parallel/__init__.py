"""Synchronous data parallelism: `DataParallelStrategy` on one host and its multi-worker
form, with the checks of the input it distributes."""

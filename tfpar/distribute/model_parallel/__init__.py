"""Model parallelism by layer placement: `ModelParallelStrategy` and its reports."""

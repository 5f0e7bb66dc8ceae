"""Pure planning logic: plain Python, never imports TensorFlow."""

from tfpar.plan.advisor import Advice, Option, advise
from tfpar.plan.memory import MemoryConfig, MemoryEstimate, estimate_memory
from tfpar.plan.units import parse_bytes, parse_count

__all__ = ["Advice", "Option", "MemoryConfig", "MemoryEstimate", "advise", "estimate_memory",
           "parse_bytes", "parse_count"]

"""Drawings of what ran (no TensorFlow): pipeline timelines as Chrome traces and PNGs."""

"""Context parallelism: attention with the sequence split over devices."""

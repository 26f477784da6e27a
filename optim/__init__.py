"""Optimizers on RaggedShard DTensors (placeholder until they land)."""

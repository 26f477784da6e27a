"""Integrations of this package's runtime with training frameworks, each through the framework's
own extension points: :mod:`ragged_placement.integrations.torchtitan` (torchtitan 0.3.0)."""

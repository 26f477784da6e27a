"""Structure-aware planner (placeholder until the planner lands)."""

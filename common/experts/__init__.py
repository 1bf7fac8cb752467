"""Expert load of MoE models: counts, figures (imbalance, trend) and the placement planner."""

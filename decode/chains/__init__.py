"""Chains from config: the builder that loads what each level names, the baselines beside them, and the planner."""

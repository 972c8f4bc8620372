"""Routing policies; each module registers its policies with `planner.policy.register`."""

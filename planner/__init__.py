"""The sans-IO brain: routing policies, cost model, workflow planning."""

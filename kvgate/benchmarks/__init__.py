"""Microbenchmarks (`kvgate microbench ...`) and, later, the workflow benchmark harness."""

"""`kvgate bench`: workloads, the virtual-time driver, live mode and the report."""

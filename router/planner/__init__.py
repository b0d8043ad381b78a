"""``pdserve plan`` and ``pdserve profile``: which layout (colocated xN, or xPyD with tensor
parallel sizes) serves a workload within its SLOs at the least cost, found by simulating each
with the workers' own scheduler (docs/planner.md)."""

"""Layout search (``megalm-plan`` / ``tools/plan.py``): which TP / PP / VPP / CP / EP / DP / sharding /
recompute / micro-batch to run on a cluster.

* :mod:`.cluster`: the cluster description (TOML file, presets) and its calibrated numbers;
* :mod:`.cost`: the step-time model of one layout (compute per op class, communication per group over the
  link it crosses, overlap, pipeline bubble);
* :mod:`.search`: every layout megalm's own validation accepts, with the reasons for those it refuses;
* :mod:`.calibrate`: measures GEMM / attention / elementwise throughput and collective bandwidth and
  latency (on the simulated cluster: through its shaped links);
* :mod:`.cli`: the command line.
"""

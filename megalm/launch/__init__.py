"""The simulated multi-node cluster: network namespaces as nodes (:mod:`megalm.launch.netns`),
one launcher at a time (:mod:`megalm.launch.lock`), torchrun on every node
(:mod:`megalm.launch.cluster`).  The command is ``tools/cluster/run.py`` (see tools/cluster/README.md)."""

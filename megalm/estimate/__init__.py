"""Memory and speed planning of a training layout (``tools/estimate.py``).

* :mod:`.parameters`: parameters on each pipeline rank (TP shards, embeddings, experts);
* :mod:`.activations`: saved activation bytes per microbatch and microbatches in flight;
* :mod:`.planner`: bytes per rank with and without the distributed optimizer, FLOPs, step time;
* :mod:`.cli`: the command line (pretrain_gpt.py's flags plus the planner's).
"""

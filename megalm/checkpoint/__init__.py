"""Training checkpoints: save, find the latest, verify, load under any parallel layout.

Modules (import them directly; this package re-exports nothing)::

    save.py          save_checkpoint_states: DCP blocks, per-rank files, common.json, manifests, tracker
    load.py          load_checkpoint_states: verify, read the blocks, restore what applies to this layout
    stateful.py      CheckpointStates: the states components register (saved per rank, by name)
    resume.py        which checkpoint: tracker, iter_NNNNNNN names, auto-resume, verification
    model_state.py   ModelOptimizerState: the model's and optimizer's tensors as blocks, under global names
    rng.py           the random generators' states as plain values
    common_json.py   common.json: format version, the layout record, reading it
    dcp_io.py        DCP save/load of blocks (planners), tensor names and shapes
    fsdp_dtensor.py  --ckpt-format fsdp_dtensor: the blocks under Megatron-FSDP's names, Megatron's byte entries
    safe_metadata.py DCP .metadata read without running code (an exact allow-list)
    manifest.py      per-rank sha256 manifests and their index; verification
    async_writer.py  --async-save: the background writer
    errors.py        CheckpointError, every rank's error shared, one-line I/O errors

The checkpointer names no feature: a component with state registers it, the model and optimizer
included (:class:`megalm.checkpoint.stateful.CheckpointStates`; docs/checkpoint-internals.md).
``save_checkpoint`` / ``load_checkpoint`` are thin wrappers for callers holding a model (tools, tests).
The blocks themselves (:class:`megalm.param_layout.ShardedTensorSpec`, ``param_spec``) live below
this package, in :mod:`megalm.param_layout`, so that the optimizers and gradient compression can
describe their tensors without importing the checkpointer.

Directory layout (Megatron-like)::

    <save>/latest_checkpointed_iteration.txt   # written last, atomically: the iteration number
    <save>/iter_0000020/
        .metadata, __*_*.distcp                # DCP: model weights and optimizer tensors
        common.json                            # iteration, consumed samples, config, scheduler, scaler
        rng/rank_00000.pt ...                  # per-rank RNG states (tensors only; weights_only load)
        <name>/rank_00000.pt ...               # each registered state (stateful.py), e.g. grad_compression/
                                               # (--grad-compression) and local_sgd/ (--local-sgd-interval)
        manifest/rank_00000.json ...           # per rank: size and sha256 of each file it wrote
        manifest.json                          # rank 0, after every rank's manifest, before the tracker

Every load verifies the checkpoint first (:func:`megalm.checkpoint.resume.verify_checkpoint`, each
rank hashing its share of the files, see :mod:`megalm.checkpoint.manifest`): a corrupt one fails with
``checkpoint DIR is corrupt: FILE: reason; previous: --ckpt-step N``, or with
``--ckpt-fallback-to-verified`` the newest older checkpoint that verifies is loaded instead.
A checkpoint written before manifests existed loads with a logged warning.  Write failures
(full disk included: the message says "No space left on device") raise
:class:`megalm.checkpoint.errors.CheckpointError` naming the directory.

Model tensors are keyed ``model.<global parameter name>`` and stored as blocks of their
full (unpadded-vocabulary) tensors, so any TP/PP/DP layout can load them (see
:mod:`megalm.checkpoint.dcp_io`).  Optimizer tensors are keyed
``optimizer.<global parameter name>.<state>`` with the parameter's layout; the distributed
optimizer saves, for each parameter range of its data-parallel shard, the blocks of the full
tensor that range covers (:func:`megalm.param_layout.param_range_specs`), with no gather: the same keys and the
same global tensors as the plain optimizer, so either loads the other's checkpoints under any
TP/PP/DP layout.  With ``--grad-compression`` the pending update of error feedback (the sum of the
data-parallel ranks' residuals) is saved as ``grad_compression.<name>.pending`` with the parameter's
layout, and PowerSGD's warm starts as ``grad_compression.<name>.powersgd_q...``: a run under another
layout reshards them (:mod:`megalm.distributed.compression.reshard`).  Nothing from a checkpoint
can run code on load: DCP's ``.metadata`` is read by :mod:`megalm.checkpoint.safe_metadata` (an exact
allow-list), tensors and per-rank states by ``torch.load(weights_only=True)``, ``common.json`` as JSON.

Only parameters are saved.  Transformer Engine modules also carry ``_extra_state`` (fp8 scaling
metadata: amax history and scales, a pickled object): it is not saved, so a TE checkpoint is
exactly a local one (same names, see :mod:`megalm.parameter_names`) and no object state is loaded;
after a load fp8 scaling restarts from fresh amax statistics (``--fp8-amax-history-len`` steps).
"""

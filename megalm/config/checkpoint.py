"""``CheckpointConfig``: saving and loading checkpoints, and the checks between its flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalm.config.fields import Section, check
from megalm.config.fields import flag_field as _f


@dataclass
class CheckpointConfig(Section):
    """Saving and loading checkpoints (torch.distributed.checkpoint)."""

    save: Optional[str] = _f(None, "Directory to save checkpoints to.")
    save_interval: Optional[int] = _f(None, "Save every this many iterations.")
    non_persistent_save_interval: Optional[int] = _f(
        None,
        "Also save every this many iterations to --non-persistent-global-ckpt-dir, keeping only the newest "
        "(cheap frequent restart points); a resume loads it when it is newer than the newest --load checkpoint.",
    )
    non_persistent_ckpt_type: Optional[str] = _f(
        None,
        "Where non-persistent checkpoints go: global (a directory on shared storage), or local (each rank's "
        "shard in its node's --non-persistent-local-ckpt-dir, a tmpfs such as /dev/shm; with --replication "
        "also on another node); a restart restores the newest of these and the --load checkpoint.",
        choices=["global", "local"],
    )
    non_persistent_global_ckpt_dir: Optional[str] = _f(
        None, "Directory of the non-persistent checkpoints (default <save>/non_persistent; read as <load>/...)."
    )
    non_persistent_local_ckpt_dir: Optional[str] = _f(
        None,
        "Directory on each node for --non-persistent-ckpt-type local (RAM: /dev/shm/...; it must outlive the "
        "worker processes, which torchrun restarts); a subdirectory per torchrun --rdzv-id and node.",
    )
    replication: bool = _f(
        False,
        "With --non-persistent-ckpt-type local: also send each rank's shard to a rank on another node "
        "(--replication-jump), so that it survives the loss of its node.",
    )
    replication_jump: Optional[int] = _f(
        None,
        "Rank n's replica goes to rank n + J (mod world); must land on another node (default: the ranks per node).",
    )
    replication_factor: int = _f(
        2,
        "Copies of each shard with --replication, the rank's own included: replicas go to ranks n + J, n + 2J, ... "
        "(--replication-jump J), which must be on different nodes; a shard survives the loss of K - 1 nodes.",
    )
    load: Optional[str] = _f(
        None,
        "Directory to load the latest checkpoint from.  With the same directory as "
        "--save and no checkpoint in it yet, training starts from scratch (Megatron's "
        "auto-resume); otherwise a missing checkpoint is an error.",
    )
    exit_on_missing_checkpoint: bool = _f(False, "Fail when --load holds no checkpoint, also when it is --save.")
    use_checkpoint_args: bool = _f(
        False, "Take the architecture and tokenizer flags not given on the command line from the checkpoint in --load."
    )
    no_load_optim: bool = _f(False, "Do not load optimizer and scheduler state.")
    no_save_optim: bool = _f(
        False, "Do not save optimizer and scheduler state (weights only: resuming needs --no-load-optim)."
    )
    no_save_rng: bool = _f(False, "Do not save random number generator states (resuming needs --no-load-rng).")
    no_load_rng: bool = _f(False, "Do not load random number generator states.")
    finetune: bool = _f(False, "Load weights only and start from iteration 0.")
    ckpt_step: Optional[int] = _f(None, "Load this iteration instead of the latest.")
    ckpt_fallback_to_verified: bool = _f(
        False,
        "When the latest checkpoint in --load fails verification (its "
        "manifest's sizes and sha256 checksums), load the newest older one "
        "that verifies instead of stopping (warning naming each one skipped).",
    )
    ckpt_format: str = _f(
        "torch_dist",
        "Checkpoint format to save (and load): torch_dist (torch.distributed.checkpoint under megalm's names, "
        "Megatron's default) or fsdp_dtensor (the same blocks under Megatron-FSDP's names: model.module.*, "
        "optimizer.state.module.module.module.*, a gated fc1 as weight_w / weight_v).  Megatron's torch, zarr and "
        "torch_dcp are refused.",
    )
    auto_detect_ckpt_format: bool = _f(
        False,
        "Load a checkpoint in whichever format it was saved (torch_dist or fsdp_dtensor), not only --ckpt-format's.",
    )
    async_save: bool = _f(
        False,
        "Write checkpoint tensors in a background thread after copying them to CPU memory; "
        "the tracker file follows when every rank's write is complete.  With --non-persistent-ckpt-type local, "
        "also the local copies' writes and exchange.",
    )

    def validate(self) -> None:
        from megalm.config.megatron_compat import UNSUPPORTED

        check(
            self.ckpt_format in ("torch_dist", "fsdp_dtensor"),
            f"--ckpt-format {self.ckpt_format} is not supported: megalm reads and writes torch_dist and fsdp_dtensor "
            f"(torch.distributed.checkpoint) only ({UNSUPPORTED['--ckpt-format']})",
        )
        check(self.save_interval is None or self.save_interval > 0, "--save-interval must be positive")
        check(not self.async_save or self.save is not None, "--async-save needs --save")
        if self.non_persistent_save_interval is not None:
            check(self.non_persistent_save_interval > 0, "--non-persistent-save-interval must be positive")
            if self.non_persistent_ckpt_type == "local":
                check(
                    self.non_persistent_local_ckpt_dir is not None,
                    "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir (e.g. /dev/shm/megalm)",
                )
            else:
                check(
                    self.save is not None or self.non_persistent_global_ckpt_dir is not None,
                    "--non-persistent-save-interval needs --save or --non-persistent-global-ckpt-dir",
                )
        check(
            self.non_persistent_ckpt_type != "local" or self.non_persistent_save_interval is not None,
            "--non-persistent-ckpt-type local needs --non-persistent-save-interval K",
        )
        check(
            not self.replication or self.non_persistent_ckpt_type == "local",
            "--replication needs --non-persistent-ckpt-type local",
        )
        check(
            self.replication_factor >= 2,
            f"--replication-factor {self.replication_factor}: at least 2 (the rank's own copy and one replica)",
        )
        check(self.replication_jump is None or self.replication_jump > 0, "--replication-jump must be positive")
        check(
            not self.ckpt_fallback_to_verified or (self.load is not None and self.ckpt_step is None),
            "--ckpt-fallback-to-verified needs --load and no --ckpt-step (an explicit step is loaded or refused)",
        )

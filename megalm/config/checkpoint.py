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
        None, "Where non-persistent checkpoints go: global (a directory on shared storage).", choices=["global"]
    )
    non_persistent_global_ckpt_dir: Optional[str] = _f(
        None, "Directory of the non-persistent checkpoints (default <save>/non_persistent; read as <load>/...)."
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
    async_save: bool = _f(
        False,
        "Write checkpoint tensors in a background thread after copying them to CPU memory; "
        "the tracker file follows when every rank's write is complete.",
    )

    def validate(self) -> None:
        check(self.save_interval is None or self.save_interval > 0, "--save-interval must be positive")
        check(not self.async_save or self.save is not None, "--async-save needs --save")
        if self.non_persistent_save_interval is not None:
            check(self.non_persistent_save_interval > 0, "--non-persistent-save-interval must be positive")
            check(
                self.non_persistent_ckpt_type in (None, "global"),
                f"--non-persistent-ckpt-type {self.non_persistent_ckpt_type} is not built (global is)",
            )
            check(
                self.save is not None or self.non_persistent_global_ckpt_dir is not None,
                "--non-persistent-save-interval needs --save or --non-persistent-global-ckpt-dir",
            )
        check(
            not self.ckpt_fallback_to_verified or (self.load is not None and self.ckpt_step is None),
            "--ckpt-fallback-to-verified needs --load and no --ckpt-step (an explicit step is loaded or refused)",
        )

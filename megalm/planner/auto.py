"""``pretrain_gpt.py --auto-layout``: the planner's first choice for this world, as pretrain_gpt.py flags.

At start-up, before anything is built, every rank runs the same search (:func:`megalm.planner.search.search`,
deterministic: every rank gets the same answer without communicating) for the model the flags describe on the
cluster of ``--cluster-config`` (a preset or TOML file; nodes = world / ``LOCAL_WORLD_SIZE``, devices per node =
``LOCAL_WORLD_SIZE``; default preset ``h100`` with CUDA, else ``cpu``), prints the chosen layout on rank 0, and
returns the flags with the first choice's layout flags in place of ``--auto-layout`` / ``--cluster-config``.
Layout flags given with ``--auto-layout`` are refused: the planner chooses them (``--overlap-grad-reduce`` and
``--overlap-param-gather``, which it sets itself, are allowed; a given ``--grad-compression int8|fp8`` is kept on
the layouts with data parallelism).  On a large cluster the search takes a while on
every rank: run ``megalm-plan`` once and pass its flags instead.
"""

from __future__ import annotations

import os
from typing import List, Optional

from megalm.config import ConfigError, build_parser, config_from_args, set_vocab_size

OWN = {"--auto-layout": 0, "--cluster-config": 1}
# the planner sets the overlap flags itself; a given --grad-compression (int8, fp8) is kept and searched with
ALLOWED = {"--overlap-grad-reduce", "--overlap-param-gather", "--grad-compression"}


def _strip(argv: List[str], flags: dict) -> List[str]:
    out, i = [], 0
    while i < len(argv):
        name = argv[i].split("=")[0]
        if name in flags:
            i += 1 + (flags[name] if "=" not in argv[i] else 0)
            continue
        out.append(argv[i])
        i += 1
    return out


def auto_layout_argv(argv: List[str], world_size: int, local_world_size: Optional[int] = None, log=print) -> List[str]:
    """``argv`` (containing ``--auto-layout``) with the planner's first choice's layout flags; raises
    :class:`ConfigError` for explicit layout flags, and when no layout fits (with the planner's reasons)."""
    from megalm.estimate.cli import _vocab_size
    from megalm.planner.cli import SEARCHED, cluster_of, compression_methods, format_result, model_flags
    from megalm.planner.search import SearchOptions, search

    given = sorted({a.split("=")[0] for a in argv if a.split("=")[0] in SEARCHED} - ALLOWED)
    if given:
        raise ConfigError(f"--auto-layout chooses the layout: drop {', '.join(given)} (or drop --auto-layout)")
    parser = build_parser(exit_on_error=False)
    cfg = config_from_args(parser.parse_args(argv))
    if cfg.training.global_batch_size is None:
        raise ConfigError("--auto-layout needs --global-batch-size (the planner keeps it and searches the rest)")
    set_vocab_size(cfg, _vocab_size(cfg))
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % local:
        raise ConfigError(f"--auto-layout: world size {world_size} is not a multiple of LOCAL_WORLD_SIZE {local}")
    spec = cfg.parallel.cluster_config or _default_cluster()
    plan_options = _PlanOptions(spec, world_size // local, local)
    cluster = cluster_of(plan_options)
    result = search(cfg, cluster, SearchOptions(compression=compression_methods("none", cfg.parallel.grad_compression)))
    base = _strip(argv, OWN | {"--grad-compression": 1})
    if not result.candidates:
        text = format_result(cfg, cluster, result, model_flags(base, parser), 0)
        raise ConfigError(f"--auto-layout: no layout fits on {world_size} ranks of {spec}:\n{text}")
    best = result.candidates[0]
    log(
        f"auto-layout ({spec}, {cluster.nodes} node(s) x {cluster.devices_per_node}): {best.layout.short()} "
        f"DP{best.dp}, predicted {best.cost.step_s * 1e3:.1f} ms/step, {best.memory_bytes / 1e9:.2f} GB/rank, "
        f"first of {len(result.candidates)} ranked: {' '.join(best.layout.flags())}"
    )
    return base + best.layout.flags()


def _default_cluster() -> str:
    import torch

    return "h100" if torch.cuda.is_available() else "cpu"


class _PlanOptions:
    """What :func:`megalm.planner.cli.cluster_of` reads: the cluster and this world's shape."""

    def __init__(self, cluster: str, nodes: int, devices_per_node: int):
        from megalm.planner.cli import CLUSTER_KEYS

        for key in CLUSTER_KEYS:
            setattr(self, key, None)
        self.cluster, self.calibrate = cluster, False
        self.nodes, self.devices_per_node = nodes, devices_per_node

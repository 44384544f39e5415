"""Training loop and its pieces; ``pretrain`` is the entry point used by pretrain_gpt.py, ``get_batch``
its forward step's micro-batch (:mod:`megalm.training.batch`)."""


def pretrain(*args, **kwargs):
    from megalm.training.training import pretrain as _pretrain

    return _pretrain(*args, **kwargs)


def get_batch(*args, **kwargs):
    from megalm.training.batch import get_batch as _get_batch

    return _get_batch(*args, **kwargs)


__all__ = ["get_batch", "pretrain"]

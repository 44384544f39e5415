"""Training loop and its pieces; ``pretrain`` is the entry point used by pretrain_gpt.py."""


def pretrain(*args, **kwargs):
    from megalm.training.training import pretrain as _pretrain

    return _pretrain(*args, **kwargs)


__all__ = ["pretrain"]

"""Errors that name what the user must change."""


class UnsupportedCheckpointError(ValueError):
    """A checkpoint we refuse at load: names the architecture, tensor, dtype or config key."""


class KVCacheTooSmallError(ValueError):
    """The KV pool cannot hold one max_model_len sequence: names the arithmetic and the flags to change."""

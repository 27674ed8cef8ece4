"""The failure that ends a multi-process engine (imported by the engine core without torch.distributed)."""


class DistributedEngineError(RuntimeError):
    """A rank died or a step failed partway through its collectives: the ranks are no longer in step, so
    the engine stops rather than fail only that step's requests."""

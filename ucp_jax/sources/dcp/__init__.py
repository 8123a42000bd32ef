"""torch.distributed.checkpoint (DCP) folders as a source."""

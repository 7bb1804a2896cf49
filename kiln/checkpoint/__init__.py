"""Checkpoints: a model's files (config, generation defaults, tokenizer) and a
reader for its tensors. Nothing here knows the model's architecture: the models
package maps tensor names and config fields onto its own."""

from kiln.checkpoint.reader import (Checkpoint, CheckpointError, CheckpointReader, QuantizedTensor, TensorInfo,
                                   open_checkpoint)

__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointReader", "QuantizedTensor", "TensorInfo", "open_checkpoint",
]

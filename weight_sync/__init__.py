"""Moving weights into the rollout engine: buckets, shared memory, the trainer's sender side.

Engine-side entry points are methods of ``rollout.RolloutEngine`` (SGLang's names):
``update_weights_from_disk``, ``update_weights_from_tensor``, ``init_weights_update_group``,
``update_weights_from_distributed``, ``destroy_weights_update_group``, ``get_weights_by_name``.
"""

from weight_sync.bucket import FlattenedTensorBucket, TensorMeta
from weight_sync.checksum import checksum_named_tensors
from weight_sync.cuda_ipc import CudaIpcBucket
from weight_sync.shm import SharedMemoryBucket, open_bucket, open_shared_bucket

__all__ = ["FlattenedTensorBucket", "TensorMeta", "SharedMemoryBucket", "CudaIpcBucket", "open_bucket",
           "open_shared_bucket", "checksum_named_tensors"]

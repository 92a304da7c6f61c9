"""Weight sync: the one layer that moves weights from a Strategy's training layout to the
rollout engines. It imports nothing else of rltrainer; ``rollout``, ``controller`` and
``strategies`` import it.

- :mod:`~rltrainer.weights.wire`: the wire format (a bucket's tensors end to end, SGLang's
  ``flattened_bucket``) and the bucketer.
- :mod:`~rltrainer.weights.versions`: every version counter in one place (its docstring says who
  writes which): per-parameter versions (send only what changed), and ``mark_loaded``, which sets an
  engine's ``weight_version`` where it lives once a sync has loaded.
- :mod:`~rltrainer.weights.sync`: ``WeightSync``, the owner of an engine's pushes (``push``, ``wait``),
  its transport, LoRA view and version.
- :mod:`~rltrainer.weights.transports`: in-process, colocated, object store, broadcast and
  shared memory, each with ``start(version) -> SyncHandle`` and ``SyncHandle.wait() -> stats``.
- :mod:`~rltrainer.weights.sender` / :mod:`~rltrainer.weights.receiver`: the training ranks' and
  the rollout processes' sides.
- :mod:`~rltrainer.weights.delta`: delta sync (``Rollout(delta=...)``): only the words that changed
  since the engines' copy, verified by checksums, with a fall back to full buckets.
- :mod:`~rltrainer.weights.staging`: a rollout process's staged syncs, received beside its
  requests and applied between two of them.
- :mod:`~rltrainer.weights.group` / :mod:`~rltrainer.weights.shm`: the broadcast process group and
  the shared-memory buffers.
"""

from rltrainer.weights.delta import DeltaSync
from rltrainer.weights.transports import (WEIGHT_TRANSPORTS, BroadcastTransport, ColocatedTransport,
                                          InProcessTransport, ObjectStoreTransport, SharedMemoryTransport, SyncHandle,
                                          WeightTransport, resolve_transport)
from rltrainer.weights.versions import ParamVersions, stepped_parameter_names
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES, Bucket, Entry, bucket_by_bytes, bucketed, plan_buckets

__all__ = ["DEFAULT_BUCKET_BYTES", "WEIGHT_TRANSPORTS", "BroadcastTransport", "Bucket", "ColocatedTransport", "DeltaSync",
           "Entry",
           "InProcessTransport", "ObjectStoreTransport", "ParamVersions", "SharedMemoryTransport", "SyncHandle",
           "WeightTransport", "bucket_by_bytes", "bucketed", "plan_buckets", "resolve_transport",
           "stepped_parameter_names"]

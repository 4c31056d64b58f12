"""The checkpoint store: node-local tier, a copy on another node, a drain to shared storage,
and a resume that never loads a torn or corrupt copy (docs/checkpoints.md).

- `shardfile`: one rank's shard of one step as one self-verifying file (a digest trailer),
  written atomically; `digest`: that digest, a SHA-256 tree hashed on several cores; `layout`: where shards lie and the inventory of a tier.
- `stage`: the state copied into reused host buffers; its payload (tagged JSON skeleton, no
  pickle, tensors at aligned offsets).
- `partner`: who keeps whose copy (switch-aware ring) and the HMAC-authenticated, bounded TCP
  transfer between the job's nodes.
- `plan`: which step a resume takes and each rank's places, pure.
- `store`: `CheckpointStore` (save, finalize, load_latest), `open_store` from site.yaml.
- `dcp`: torch.distributed.checkpoint's StorageWriter/StorageReader over the store.

Standard library only at import (torch is imported inside the functions that need it); the
hooks and the CLI import at most `layout` (the epilog's clean-up).
"""

"""The export of a trained adapter, proven outside SkyRL-tx: `proof` (transformers + peft load the adapter
and reproduce SkyRL's figures; the merge) and `writer` (convert, prove, merge, commit). The records and
files it reads and writes are `txflow.checkpoints.export`'s; this room is the one that loads models.
"""

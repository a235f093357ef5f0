"""Checkpoints in durable storage, on any fsspec URL.

`markers` (the commit marker written last, with every file's size and MD5), `storage` (commit from the
engine's staging to the run root, import back, resume points), `discovery` (what a root holds, in any
format, and whether each checkpoint is complete), `export` (the exported adapter's records and files),
`promotion`, `retention`, `lease` and `names`. Knows SkyRL-tx's layout through `upstream`, and nothing of
clusters or models.
"""

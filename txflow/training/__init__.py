"""What a train, save-checkpoint and evaluate-restore step do on a running cluster: `loop` (the sft and rl
training loop, and the custom client's run), `sft`, `rl` (with `rewards`), `custom` (the user's own
client), `datasets` (JSONL through fsspec and the order a run reads it in), `tokenizer` (pre-flight
tokenization), `clients` (training clients, fresh or holding a durable state), `evaluation` (measurements
shared by the live and the restored model), `saving` (the final checkpoints, committed), `restore` (the
restore check) and `verdict` (the quality bars and every check, as pure functions).
"""

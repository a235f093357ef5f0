"""What a train step does on a running cluster: `sft`, `rl` (with `rewards`),
`custom` (the user's own client), `datasets` (JSONL through fsspec and the
order a run reads it in), `tokenizer` (pre-flight tokenization),
`evaluation` (measurements shared by the live and the restored model) and
`clients` (training clients, fresh or holding a durable state).
"""

"""What a run tells its users: `report` (`RunReport`, report.json, the curve, Prefect artifacts), `bar` (a
terminal bar and a progress artifact while training), `metrics` (metrics.jsonl) and `history` (the nightly
history and its comparison).
"""

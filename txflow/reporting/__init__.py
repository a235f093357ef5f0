"""What a run tells its users: `report` (report.json, the curve, Prefect
artifacts), `progress` (a terminal bar and a progress artifact), `metrics`
(metrics.jsonl) and `history` (the nightly history and its comparison).
"""

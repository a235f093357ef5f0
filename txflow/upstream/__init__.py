"""What txflow runs but does not own: SkyRL-tx and the Tinker SDKs.

`skyrl_tx/` is the one adapter of the pinned SkyRL-tx version: every patch of
its processes, named by a slug in one table (`skyrl_tx.patches`) with what goes
wrong upstream and when it can go, the shims that let newer Tinker SDKs talk to
it, and the version guard. `wake` is the wake channel the API and the engine use
(the `wake-channel` change); `tiny_model` builds the small Qwen3 model the
offline default loads. Imports only `processes`, `config` and `log`.
"""

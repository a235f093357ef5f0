"""`txflow serve`: what a run trained, answered through OpenAI's text API (`/v1/models`, `/v1/completions`,
`/v1/chat/completions`) by a warm cluster's Tinker sampler, so that a person can talk to it and any tool that
speaks OpenAI can evaluate it. `models` loads what is served onto the cluster; `openai_api` is the HTTP side."""

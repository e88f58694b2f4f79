"""The web server (`strata serve`): OpenAI-compatible API, /metrics, health. Never imports torch."""

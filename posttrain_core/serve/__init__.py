"""Training as a service: many tenants' LoRA adapters on shared base models, driven over HTTP by the unmodified
tinker SDK, with every saved state a store artifact (docs/serve.md)."""

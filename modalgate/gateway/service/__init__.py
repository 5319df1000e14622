"""The gateway's own endpoints: models catalog, /v1/encode, health, the embeds rewrite."""

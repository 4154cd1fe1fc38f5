"""The run configuration: sections, loading (TOML and overrides), validation, the memory model."""

"""specline building blocks, importable without Ray, cut by concern (see docs/architecture.md)."""

"""specline building blocks, importable without Ray, cut by concern (see DESIGN.md)."""

"""Model execution: weight loaders, model definitions and their layers."""

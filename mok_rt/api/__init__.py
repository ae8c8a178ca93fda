"""The public API: configuration, workspace, argument validation, the layer functions."""

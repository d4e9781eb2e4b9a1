"""Model preset YAML files, shipped inside the package as ``commbench.presets``."""

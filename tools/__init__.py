"""Command-line tools (no ComfyUI needed): ``python -m h3_turbo.tools --help``."""

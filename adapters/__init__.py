"""Adapters: Turbo LoRA validation, conversion, residency and the runtime branch; Turbo contracts."""

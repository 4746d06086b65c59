"""Checkpoint formats: safetensors header checks, NVFP4 (E2M1 + e4m3 block scales), format detection."""

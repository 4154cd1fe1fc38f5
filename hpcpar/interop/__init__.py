"""Interchange with other tools: HuggingFace GPT-2 weights and the safetensors format."""

"""Reading the base's checkpoint: the safetensors files (where they live, their headers, one tensor at a time:
files.py) and transformers' key renames applied to their index (conversions.py)."""

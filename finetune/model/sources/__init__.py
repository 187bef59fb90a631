"""Where the base model comes from: a folder or a hub id (hub.py: hub arguments, the offline guard, load errors), and its
weights, read one tensor at a time: the safetensors files (where they live, their headers: files.py), transformers' key
renames applied to their index (conversions.py), a rank's share of each tensor read from the file (shard_reads.py), and
GGUF files converted to a transformers folder once (gguf.py)."""

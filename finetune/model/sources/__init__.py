"""Where the base model's weights come from, read one tensor at a time: the safetensors files (where they live, their
headers, one tensor at a time: files.py), transformers' key renames applied to their index (conversions.py), a rank's
share of each tensor read from the file (shard_reads.py), and GGUF files converted to a transformers folder once
(gguf.py)."""

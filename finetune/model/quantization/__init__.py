"""4-bit weights stored ahead of training: checkpoints in transformers' bitsandbytes layout read as they are
(prequantized.py), a bf16 base written as one (writer.py, `finetune quantize`), and the cache that does so once per
base (cache.py, model.quantized_cache: auto)."""

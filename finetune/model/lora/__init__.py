"""LoRA on the 4-bit base: the initialization of the adapters (init.py) and the fused path that computes a 4-bit layer
and its adapter in one op (fused.py). PEFT attaches the adapters (model/base.py: attach_lora); the experts' LoRA, per
expert projection, is the experts family interface's (model/experts/lora.py)."""

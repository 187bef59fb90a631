"""LoRA on the 4-bit base: attached by PEFT from the recipe or model.adapter (attach.py), the initialization of the
adapters (init.py) and the fused path that computes a 4-bit layer and its adapter in one op (fused.py); the experts'
LoRA, per expert projection, is the experts family interface's (model/experts/lora.py)."""
